"""A `shoal run --interactive` cluster for tests: free ports, the HTTP API, clean shutdown."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request


# Ports handed out in this test process: nothing listens on them until the processes a test
# starts bind them, so without this two calls could return the same port. They did: a cluster
# file got one port for a builder and the writer, and the builder could not start.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on (TCP or UDP) and not handed out before, outside
    the kernel's ephemeral range: a port from that range (what binding port 0 gives) can be
    taken by an outgoing connection before the process the test starts binds it. Random,
    so tests running at once rarely collide (as tests/common's `free_port` in Rust)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    first, last = (10000, lo - 1) if lo > 11000 else (hi + 1, 65535)
    for _ in range(10000):
        port = random.randint(first, last)
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                t.bind(("127.0.0.1", port))
                u.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {first}-{last}")


def on_free_ports(text: str) -> str:
    """A shipped cluster file with every fixed local port (`127.0.0.1:NNNN`) moved to a free
    one, the same port for the same number, so tests never collide with anything listening."""
    ports: dict[str, int] = {}

    def move(m: re.Match) -> str:
        if m.group(1) == "0":
            return m.group(0)
        return f"127.0.0.1:{ports.setdefault(m.group(1), free_port())}"

    return re.sub(r"127\.0\.0\.1:(\d+)", move, text)


def cluster_toml(
    name: str,
    sources: int,
    builders: int,
    state_dir: pathlib.Path,
    restarts: int = 3,
    *,
    policy: str = "delayed:2",
    slice_ms: int | None = None,
    cluster_tables: tuple[str, ...] = (),
    process_lines=lambda process: [],
    source_lines: tuple[str, ...] = (),
    builder_lines: tuple[str, ...] = (),
    writer_lines: tuple[str, ...] = (),
    source_drain_ms: int = 2000,
    builder_drain_ms: int = 4000,
) -> str:
    """A cluster file of `sources` and `builders` (one process each), the writer, and under a
    pull policy the data-flow manager, on free loopback ports. `cluster_tables`: tables
    after `[cluster]`'s keys (`[cluster.clock]`, ...); `process_lines(name)`: lines for that
    process's table; `source_lines`, `builder_lines`, `writer_lines`: for `[config.source]`,
    `[config.builder]` (a sub-table last), `[config.writer]`."""
    pull = policy.startswith("pull")
    lines = [
        "[cluster]",
        f'name = "{name}"',
        f'dispatcher = "127.0.0.1:{free_port()}"',
        f'dispatcher_http = "127.0.0.1:{free_port()}"',
        f'state_dir = "{state_dir}"',
        "reply_timeout_ms = 5000",
        "stats_interval_ms = 500",
        f"restarts = {restarts}",
        *cluster_tables,
        "",
    ]
    names = ["writer", *(["dfm"] if pull else []), *(f"builder{b}" for b in range(builders)),
             *(f"source{s}" for s in range(sources))]
    for n in names:
        role = n.rstrip("0123456789")
        ids = [f"ids = [{n.removeprefix(role)}]"] if role in ("builder", "source") else []
        lines += ["[[process]]", f'name = "{n}"', f'role = "{role}"', *ids, *process_lines(n)]
    addrs = ", ".join(f'"127.0.0.1:{free_port()}"' for _ in range(builders))
    lines += [
        "[config.run]",
        *([f"slice_ms = {slice_ms}"] if slice_ms else []),
        f"sources = {sources}",
        f"builders = {builders}",
        f'policy = "{policy}"',
        f"builder_addrs = [{addrs}]",
        f'writer_addr = "127.0.0.1:{free_port()}"',
        *([f'dfm_addr = "127.0.0.1:{free_port()}"'] if pull else []),
        "[config.source]",
        f"drain_timeout_ms = {source_drain_ms}",
        *source_lines,
        "[config.builder]",
        f"drain_timeout_ms = {builder_drain_ms}",
        *builder_lines,
        "[config.writer]",
        f'out_dir = "{state_dir / "data"}"',
        *writer_lines,
    ]
    return "\n".join(lines) + "\n"


class Cluster:
    """`shoal run FILE --interactive` in the background, driven over its HTTP API."""

    def __init__(
        self,
        shoal_bin: pathlib.Path,
        workdir: pathlib.Path,
        sources: int = 5,
        builders: int = 3,
        restarts: int = 3,
        text: str | None = None,
        token: str | None = None,
        cafile: pathlib.Path | None = None,
    ):
        """Starts the generated cluster, or the cluster file `text` (its state_dir must be
        `workdir / "state"`). `token`: sent as a bearer token with every request; `cafile`:
        the CA that signed run control's certificate (an HTTPS API)."""
        self.token = token
        self.ssl = None
        if cafile is not None:
            import ssl

            self.ssl = ssl.create_default_context(cafile=str(cafile))
        self.workdir = workdir
        self.state_dir = workdir / "state"
        self.file = workdir / "cluster.toml"
        self.file.write_text(text or cluster_toml("test", sources, builders, self.state_dir, restarts))
        self.log = open(workdir / "shoal-run.log", "w")
        self.proc = subprocess.Popen(
            [str(shoal_bin), "run", str(self.file), "--interactive", "--http", "127.0.0.1:0"],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.url = None
        self.pids: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("run control UI: "):
                self.url = line.split(": ", 1)[1].strip().rstrip("/")
                break
        if self.url is None:
            self.close()
            raise RuntimeError(f"shoal run did not start; see {workdir / 'shoal-run.log'}")

    def dispatcher(self) -> tuple[str, int]:
        host, port = re.search(r'^dispatcher = "([\d.]+):(\d+)"', self.file.read_text(), re.M).groups()
        return host, int(port)

    # -- API -------------------------------------------------------------------------
    def request(self, path: str, method: str = "GET", token: str | None = None) -> urllib.request.Request:
        req = urllib.request.Request(self.url + path, method=method)
        token = token or self.token
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        return req

    def open(self, req: urllib.request.Request):
        return urllib.request.urlopen(req, timeout=10, context=self.ssl)

    def get(self, path: str):
        with self.open(self.request(path)) as r:
            return json.loads(r.read())

    def status(self) -> dict:
        s = self.get("/api/status")
        self.pids.update(p["pid"] for p in s["processes"] if p["pid"])
        return s

    def command(self, name: str, token: str | None = None) -> int:
        req = self.request("/api/command/" + name, method="POST", token=token)
        try:
            with self.open(req) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait(self, predicate, timeout: float = 60.0, what: str = "condition") -> dict:
        """Polls the status until `predicate(status)` holds (bounded)."""
        deadline = time.monotonic() + timeout
        s = self.status()
        while time.monotonic() < deadline:
            s = self.status()
            if predicate(s):
                return s
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(s)[:2000]}")

    def wait_file(self, path: pathlib.Path, timeout: float = 60.0) -> pathlib.Path:
        """Polls until `path` exists (bounded): a run record is written once the run ends."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out waiting for {path}")
            time.sleep(0.05)
        return path

    def run_command(self, name: str, state: str, timeout: float = 60.0) -> dict:
        """Sends a command once the previous one is done and waits for the cluster state."""
        self.wait(lambda s: s["busy"] is None, timeout, "run control to be idle")
        assert self.command(name) == 202
        return self.wait(lambda s: s["busy"] is None and s["state"] == state, timeout, f"{name} -> {state}")

    def process(self, status: dict, name: str) -> dict:
        return next(p for p in status["processes"] if p["name"] == name)

    # -- shutdown --------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None and self.url is not None:
            try:
                self.wait(lambda s: s["busy"] is None, 30, "run control to be idle")
                self.command("OFF")
            except Exception:
                pass
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
            # The processes it launched have their own process groups.
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()
        return rc
