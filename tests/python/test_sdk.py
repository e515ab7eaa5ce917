"""Real data in, end to end: one run whose fragments all come from user code.

- source 0: the C example `unix_readout` writes the input framing to a `shoal node --role
  source` process's unix socket (`source.input = "unix:PATH"`);
- source 1: the C example `readout` links libshoal and submits through the C ABI;
- sources 2-4: this Python process through `import shoal` (bytes, 64 kB-class numpy
  arrays held without a copy, and hit records as a numpy structured array).

Builders and the writer are `shoal node` processes. Every payload must be in the writer's
slice file byte for byte, and `shoal ledger` over every process's report must balance,
with the inputs' own counts (accepted, refused) as submitted.

The sources produce a slice when every hosted board's data has moved past it
(`source.saturate`: data-driven), and the builders' slice timeouts are out of reach: the
test checks what arrives, not how fast this machine is.
"""

import json
import os
import pathlib
import subprocess
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import shoal
from shoal_cluster import free_port

SLICES = 30
SLICE_MS = 10
RUN = 7
C_EXAMPLES = pathlib.Path(os.environ.get("SHOAL_C_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "target" / "c"))
HIT = np.dtype([("channel", "u1"), ("time_ns", "<u4"), ("amplitude", "u1")])


def pattern(source: int, slice_: int) -> bytes:
    """examples/c/pattern.h: the C examples' payload of (source, slice)."""
    n = 100 + (slice_ * 37 + source * 101) % 3000
    return ((np.arange(n, dtype=np.uint64) ^ np.uint64(slice_ * 31) ^ np.uint64(source << 3)) & 0xFF).astype(np.uint8).tobytes()


def big(slice_: int) -> np.ndarray:
    """Source 3's payload: a numpy array over the 16 KiB line, so it is held, not copied."""
    n = 20_000 + 1_000 * slice_
    return ((np.arange(n, dtype=np.uint64) * 7 + slice_) & 0xFF).astype(np.uint8)


def hits(slice_: int) -> np.ndarray:
    """Source 4's payload: hit records as a structured array (6 bytes each)."""
    h = np.zeros(5 + slice_ % 4, dtype=HIT)
    h["channel"] = np.arange(len(h)) % 3
    h["time_ns"] = np.arange(len(h)) * 1000 + slice_
    h["amplitude"] = 20
    return h


def to_toml(d: dict, prefix: str = "") -> str:
    """A small TOML writer for the nested dicts of these tests."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {value(v)}")
    out = "\n".join(lines) + "\n"
    for k, v in tables:
        name = f"{prefix}{k}"
        out += f"\n[{name}]\n" + to_toml(v, name + ".")
    return out


@pytest.fixture
def run_config(tmp_path):
    out = tmp_path / "out"
    builders = 2
    # Every process agrees on the first slice: a little ahead of now (data-driven
    # production does not depend on how far).
    start = time.time_ns() // (SLICE_MS * 1_000_000) + 100
    return {
        "run": {
            "run_number": RUN,
            "seconds": 0.0,
            "slice_ms": SLICE_MS,
            "sources": 5,
            "builders": builders,
            "builder_addrs": [f"127.0.0.1:{free_port()}" for _ in range(builders)],
            "writer_addr": f"127.0.0.1:{free_port()}",
            "start_slice": start,
        },
        "source": {"input_time_base": "run", "saturate": True},
        "builder": {
            "store_slices": True,
            "max_active": 100_000,
            "wall_timeout_ms": 600_000,
            "drain_timeout_ms": 60_000,
            "filter": {"name": "none"},
        },
        "saver": {"enabled": False},
        "writer": {"out_dir": str(out)},
    }


def spawn(args, log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def wait(p: subprocess.Popen, what: str, log: pathlib.Path, timeout: float = 120) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{what} did not finish: {log.read_text()[-3000:]}")
    assert rc == 0, f"{what} exited {rc}: {log.read_text()[-3000:]}"


def wait_nodes(builders, writer, log_dir: pathlib.Path) -> None:
    """The builders and the writer end by themselves once every source has ended."""
    for b, p in enumerate(builders):
        wait(p, f"builder {b}", log_dir / f"builder{b}.log")
    wait(writer, "writer", log_dir / "writer.log")


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_c_unix_c_abi_and_python_fragments_arrive_byte_for_byte_and_balance(shoal_bin, tmp_path, run_config):
    cfg = run_config
    out = pathlib.Path(cfg["writer"]["out_dir"])
    out.mkdir()
    procs = []
    try:
        # The writer and the builders, as separate processes.
        path = tmp_path / "run.toml"
        path.write_text(to_toml(cfg))
        writer = spawn([str(shoal_bin), "node", "--role", "writer", "--config", str(path)], tmp_path / "writer.log")
        procs.append(writer)
        builders = [
            spawn([str(shoal_bin), "node", "--role", "builder", "--ids", str(b), "--config", str(path)], tmp_path / f"builder{b}.log")
            for b in range(cfg["run"]["builders"])
        ]
        procs += builders

        # Source 0: a source process with a unix input, fed by the C example.
        sock = tmp_path / "readout.sock"
        unix_cfg = json.loads(json.dumps(cfg))
        unix_cfg["source"].update({"ids": [0], "input": f"unix:{sock}"})
        (tmp_path / "unix.toml").write_text(to_toml(unix_cfg))
        unix_node = spawn([str(shoal_bin), "node", "--role", "source", "--config", str(tmp_path / "unix.toml")], tmp_path / "source0.log")
        procs.append(unix_node)
        readout_unix = spawn([str(C_EXAMPLES / "unix_readout"), str(sock), "0", "1", str(SLICES), str(SLICE_MS)], tmp_path / "unix_readout.log")
        procs.append(readout_unix)

        # Source 1: the C example on libshoal.
        c_cfg = json.loads(json.dumps(cfg))
        c_cfg["source"]["ids"] = [1]
        (tmp_path / "c.toml").write_text(to_toml(c_cfg))
        c_report = tmp_path / "c_readout.json"
        readout_c = subprocess.Popen(
            [str(C_EXAMPLES / "readout"), str(tmp_path / "c.toml"), "1", "1", str(SLICES), str(SLICE_MS)],
            stdout=open(c_report, "w"),
            stderr=open(tmp_path / "c_readout.log", "w"),
        )
        procs.append(readout_c)

        # Sources 2-4: this process, through the Python module.
        py_cfg = json.loads(json.dumps(cfg))
        py_cfg["source"]["ids"] = [2, 3, 4]
        src = shoal.Source(py_cfg)
        assert src.first_slice == cfg["run"]["start_slice"]
        slice_ns = SLICE_MS * 1_000_000
        for s in range(SLICES):
            t = s * slice_ns + 4_000_000
            assert src.submit(2, t, pattern(2, s)) == cfg["run"]["start_slice"] + s
            src.submit(3, t, big(s))
            src.submit(4, t, hits(s), hit_count=len(hits(s)))
        # Refused and counted, nothing else disturbed.
        with pytest.raises(shoal.Refused, match="unknown_source"):
            src.submit(0, 0, b"not my board")
        with pytest.raises(shoal.Refused, match="before_run"):
            src.submit_slice(2, cfg["run"]["start_slice"] - 1, b"x")
        with pytest.raises(shoal.Refused, match="bad_hits"):
            src.submit(4, 0, b"12345", hit_count=1)
        with pytest.raises(ValueError, match="C-contiguous"):
            src.submit(3, 0, np.zeros((8, 8), dtype=np.uint8)[:, ::2])
        assert src.flush(120.0)
        py_report = src.close()
        assert py_report["ingest"]["accepted"] == 3 * SLICES
        assert py_report["ingest"]["rejected"] == {"unknown_source": 1, "before_run": 1, "bad_hits": 1}
        with pytest.raises(shoal.Closed):
            src.submit(2, 0, b"after close")
        (tmp_path / "py.json").write_text(json.dumps(py_report))

        wait(readout_unix, "unix_readout", tmp_path / "unix_readout.log")
        wait(readout_c, "readout (C ABI)", tmp_path / "c_readout.log")
        wait(unix_node, "the unix-input source process", tmp_path / "source0.log")
        wait_nodes(builders, writer, tmp_path)
    finally:
        kill_all(procs)

    c = json.loads(c_report.read_text())
    assert c["ingest"]["accepted"] == SLICES and c["ingest"]["rejected"] == {"unknown_source": 1}, c["ingest"]
    unix = json.loads((out / f"run{RUN:06}.source0.json").read_text())
    assert unix["ingest"]["accepted"] == SLICES and unix["ingest"]["rejected"] == {}, unix["ingest"]

    # One ledger over every process's report, as run control would make it.
    reports = [tmp_path / "py.json", c_report, out / f"run{RUN:06}.source0.json"]
    reports += [out / f"run{RUN:06}.builder{b}.json" for b in range(cfg["run"]["builders"])]
    r = subprocess.run([str(shoal_bin), "ledger", *map(str, reports)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    books = json.loads(r.stdout)
    assert (books["sources"], books["builders"]) == (5, 2)
    ledger = books["ledger"]
    assert ledger["balanced"] and ledger["unaccounted"] == 0, ledger
    assert ledger["produced"] == 5 * SLICES, ledger
    assert ledger["buckets"]["delivered"] == 5 * SLICES, ledger
    assert books["input"]["accepted"] == 5 * SLICES and books["input"]["balanced"]

    # Every payload, byte for byte, in the slice file.
    table = pq.read_table(out / f"run{RUN:06}.slices.parquet").to_pydict()
    assert set(table["stream"]) == {"slice"}
    stored = {(sl - cfg["run"]["start_slice"], so): bytes(p) for sl, so, p in zip(table["slice"], table["source"], table["payload"])}
    assert len(stored) == 5 * SLICES
    for s in range(SLICES):
        assert stored[(s, 0)] == pattern(0, s), f"unix input, slice {s}"
        assert stored[(s, 1)] == pattern(1, s), f"C ABI, slice {s}"
        assert stored[(s, 2)] == pattern(2, s), f"Python bytes, slice {s}"
        assert stored[(s, 3)] == big(s).tobytes(), f"Python numpy, slice {s}"
        assert stored[(s, 4)] == hits(s).tobytes(), f"Python hits, slice {s}"
    hit_counts = {(sl - cfg["run"]["start_slice"], so): n for sl, so, n in zip(table["slice"], table["source"], table["hit_count"])}
    assert all(hit_counts[(s, 4)] == len(hits(s)) for s in range(SLICES))
    assert all(hit_counts[(s, 3)] == 0 for s in range(SLICES))


RUST_EXAMPLES = pathlib.Path(os.environ.get("SHOAL_RUST_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "target" / "release" / "examples"))
PY_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "readout.py"


def test_the_documented_readout_examples_in_rust_and_python(shoal_bin, tmp_path, run_config):
    """docs/sdk.md's complete examples: the Rust readout (boards 0-1) and the Python one
    (boards 2-4), each its own process, into one run; the payloads arrive byte for byte
    and the ledger over their reports balances."""
    import sys

    cfg = run_config
    out = pathlib.Path(cfg["writer"]["out_dir"])
    out.mkdir()
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    procs, reports = [], []
    try:
        writer = spawn([str(shoal_bin), "node", "--role", "writer", "--config", str(path)], tmp_path / "writer.log")
        builders = [
            spawn([str(shoal_bin), "node", "--role", "builder", "--ids", str(b), "--config", str(path)], tmp_path / f"builder{b}.log")
            for b in range(cfg["run"]["builders"])
        ]
        procs += [writer, *builders]
        readouts = []
        for name, cmd, ids in [
            ("rust", [str(RUST_EXAMPLES / "readout")], [0, 1]),
            ("python", [sys.executable, str(PY_EXAMPLE)], [2, 3, 4]),
        ]:
            c = json.loads(json.dumps(cfg))
            c["source"]["ids"] = ids
            (tmp_path / f"{name}.toml").write_text(to_toml(c))
            report = tmp_path / f"{name}.json"
            reports.append(report)
            p = subprocess.Popen([*cmd, str(tmp_path / f"{name}.toml"), str(ids[0]), str(len(ids)), str(SLICES), str(SLICE_MS)],
                                 stdout=open(report, "w"), stderr=open(tmp_path / f"{name}.log", "w"))
            procs.append(p)
            readouts.append((name, p))
        for name, p in readouts:
            wait(p, f"the {name} readout", tmp_path / f"{name}.log")
        wait_nodes(builders, writer, tmp_path)
    finally:
        kill_all(procs)

    builder_reports = [out / f"run{RUN:06}.builder{b}.json" for b in range(cfg["run"]["builders"])]
    r = subprocess.run([str(shoal_bin), "ledger", *map(str, reports + builder_reports)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    ledger = json.loads(r.stdout)["ledger"]
    assert ledger["balanced"] and ledger["buckets"]["delivered"] == 5 * SLICES, ledger
    table = pq.read_table(out / f"run{RUN:06}.slices.parquet").to_pydict()
    stored = {(sl - cfg["run"]["start_slice"], so): bytes(p) for sl, so, p in zip(table["slice"], table["source"], table["payload"])}
    assert len(stored) == 5 * SLICES
    for s in range(SLICES):
        for board in range(5):
            assert stored[(s, board)] == pattern(board, s), f"board {board}, slice {s}"
