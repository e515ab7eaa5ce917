"""Shared-memory slice consumers (docs/plugins.md, "Slice consumers").

A run (`shoal demo`) whose builders filter with the built-in `l1`, publish their slices
into the shared-memory ring and also store them whole in slices.parquet. Consumers in Python
(`shoal.slices`, in this process), C (examples/c/consumer.c on libshoal) and Rust (`shoal
consume`) attach; every slice each one read must be the stored slice, byte for byte (Python,
C) or fragment for fragment (Rust), and the builder's counters must agree with what each
consumer saw. The Python consumer also runs the numpy `l1` of examples/python/l1_filter.py
on every slice it reads: its events must be the built-in `l1`'s, as the writer stored them. Then
the kill tests: a consumer killed with SIGKILL while it holds slices does not stall the
builder; a builder killed with SIGKILL leaves nothing in /dev/shm and the next run on the
same names starts without any cleanup."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
import shoal.slices

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import l1_filter  # noqa: E402  (examples/python/l1_filter.py)

C_EXAMPLES = pathlib.Path(os.environ.get("SHOAL_C_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "target" / "c"))


def socket_template(tmp_path) -> str:
    # Unique per test: abstract names are machine-wide.
    return f"shoal-test/{os.getpid()}/{tmp_path.name}/b{{builder}}"


def write_config(tmp_path, seconds: float, extra: str = "", slice_ms: int = 0) -> pathlib.Path:
    cfg = tmp_path / "shoal.toml"
    cfg.write_text(
        f"[run]\nsources = 5\nbuilders = 2\nseconds = {seconds}\n"
        + (f"slice_ms = {slice_ms}\n" if slice_ms else "")
        + "[builder]\nstore_slices = true\n"
        "[builder.filter]\nname = \"l1\"\n"
        f"[builder.consumers]\nenabled = true\nsocket = \"{socket_template(tmp_path)}\"\n" + extra
    )
    return cfg


def demo(shoal_bin, cfg: pathlib.Path, out: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(shoal_bin), "demo", "--config", str(cfg), "--out", str(out), "--json"],
        stdout=subprocess.PIPE, stderr=open(out.parent / f"{out.name}.log", "w"), text=True,
    )


def sums(chunks) -> tuple[int, int]:
    """Byte sum and position-weighted byte sum (mod 2^64) of the concatenated chunks:
    the checksum examples/c/consumer.c prints."""
    total, weighted, at = np.uint64(0), np.uint64(0), 0
    for c in chunks:
        b = np.frombuffer(c, dtype=np.uint8).astype(np.uint64)
        pos = np.arange(at + 1, at + 1 + len(b), dtype=np.uint64)
        total += b.sum(dtype=np.uint64)
        weighted += (b * pos).sum(dtype=np.uint64)
        at += len(b)
    return int(total), int(weighted)


def stored_slices(out: pathlib.Path, builder_slices: set[int]) -> dict[int, list[tuple[int, bytes]]]:
    t = pq.read_table(next(out.glob("run*.slices.parquet")), columns=["slice", "source", "payload"]).to_pylist()
    by_slice: dict[int, list[tuple[int, bytes]]] = {}
    for row in t:
        if row["slice"] in builder_slices:
            by_slice.setdefault(row["slice"], []).append((row["source"], row["payload"]))
    return {k: sorted(v) for k, v in by_slice.items()}


def canonical_events(events) -> list:
    """Events as sorted lists of (time_ns, source, channel, amplitude, triggered)."""
    out = []
    for _mask, hits in events:
        out.append(sorted(zip(hits["time_ns"].tolist(), hits["source"].tolist(), hits["channel"].tolist(),
                              hits["amplitude"].tolist(), [bool(x) for x in hits["triggered"].tolist()])))
    return sorted(out)


def stored_events(out: pathlib.Path) -> dict[int, list]:
    by_slice: dict[int, list] = {}
    for row in pq.read_table(next(out.glob("run*.events.parquet")), columns=["slice", "hits"]).to_pylist():
        hits = sorted((h["time_ns"], h["source"], h["channel"], h["amplitude"], h["triggered"]) for h in row["hits"])
        by_slice.setdefault(row["slice"], []).append(hits)
    return {k: sorted(v) for k, v in by_slice.items()}


def python_consumer(name: str, seen: list, errors: list):
    try:
        with shoal.slices.Consumer(socket=name, policy="hold", hold_ms=600_000, window=4, wait_s=60) as c:
            for s in c:
                frags = sorted((f.source, f.payload) for f in s.fragments)
                hits = sum(len(s.hits(f)) for f in s.fragments if not f.flags & 0x8)
                selected = canonical_events(l1_filter.l1(s))
                seen.append((s.slice, [src for src, _ in frags], sums(p for _, p in frags), hits, selected, s.release()))
            seen.append(("end", c.end))
    except Exception as e:  # reported by the test, not lost in the thread
        errors.append(repr(e))


def test_python_c_and_rust_consumers_read_every_slice_they_are_offered_in_place(shoal_bin, tmp_path):
    # The consumers hold: the builder waits for every release (bound far beyond any load).
    cfg = write_config(tmp_path, 2.0, "max_hold_ms = 600000\n")
    b0 = shoal.slices.socket_name(socket_template(tmp_path), 0)
    b1 = shoal.slices.socket_name(socket_template(tmp_path), 1)
    seen, errors = [], []
    py = threading.Thread(target=python_consumer, args=(b0, seen, errors))
    py.start()
    c_out = open(tmp_path / "c.jsonl", "w")
    c_consumer = subprocess.Popen([str(C_EXAMPLES / "consumer"), b0, "600000"], stdout=c_out, stderr=subprocess.PIPE, text=True)
    rust = subprocess.Popen(
        [str(shoal_bin), "consume", "--socket", socket_template(tmp_path), "--builder", "1", "--policy", "hold", "--hold-ms", "600000", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    run = demo(shoal_bin, cfg, tmp_path / "out")
    summary, _ = run.communicate(timeout=300)
    assert run.returncode == 0, (tmp_path / "out.log").read_text()[-3000:]
    py.join(timeout=120)
    assert not errors, errors
    assert c_consumer.wait(timeout=120) == 0, c_consumer.stderr.read()
    rust_out, rust_err = rust.communicate(timeout=120)
    assert rust.returncode == 0, rust_err

    s = json.loads(summary)
    assert s["ledger"]["balanced"]
    reports = s["builder_reports"]
    all_slices = pq.read_table(next((tmp_path / "out").glob("run*.slices.parquet")), columns=["slice"]).column("slice").to_pylist()
    stored = stored_slices(tmp_path / "out", set(all_slices))

    # Python, builder 0: every slice it read is the stored slice, byte for byte.
    end = seen.pop()
    assert end[0] == "end"
    assert len(seen) >= 10, f"only {len(seen)} slices seen"
    events = stored_events(tmp_path / "out")
    selected_somewhere = 0
    for slice_, sources, checksum, hits, selected, intact in seen:
        assert intact, f"slice {slice_} was overwritten while read"
        # The numpy l1 on the consumer's view selects what the builder's built-in l1 did.
        assert selected == events.get(slice_, []), f"slice {slice_}"
        selected_somewhere += len(selected)
        assert sources == [src for src, _ in stored[slice_]]
        assert checksum == sums(p for _, p in stored[slice_]), f"slice {slice_}"
        assert hits > 0
    assert selected_somewhere > 0, "no event in any slice read: nothing compared"
    # C, builder 0: the same, through the C ABI.
    c_lines = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    c_end = c_lines.pop()
    assert c_end["end"] and len(c_lines) >= 10
    for line in c_lines:
        assert line["intact"] == 1
        assert (line["sum"], line["wsum"]) == sums(p for _, p in stored[line["slice"]]), line["slice"]
    # Rust (`shoal consume`), builder 1: fragment and byte counts.
    r_lines = [json.loads(line) for line in rust_out.splitlines()]
    r_end = r_lines.pop()
    assert r_end["end"] and len(r_lines) >= 10
    for line in r_lines:
        frags = stored[line["slice"]]
        assert (line["fragments"], line["bytes"], line["intact"]) == (len(frags), sum(len(p) for _, p in frags), True)

    # The builders' books agree with what each consumer saw.
    pub0, pub1 = reports[0]["consumers"], reports[1]["consumers"]
    assert pub0["attached"] == 2 and pub1["attached"] == 1
    offered0 = sorted(c["offered"] for c in pub0["consumers"])
    assert offered0 == sorted([end[1]["offered"], c_end["offered"]])
    assert end[1]["offered"] == len(seen) and c_end["offered"] == len(c_lines)
    assert pub1["consumers"][0]["offered"] == len(r_lines) == r_end["offered"]
    for pub in (pub0, pub1):
        assert pub["dropped"] == 0 and pub["refused"] == 0 and pub["too_large"] == 0
        for c in pub["consumers"]:
            assert c["released"] == c["offered"] and c["overrun"] == 0 and c["skipped"] == 0, c
    # Every processed (stored) slice was published, or found nobody attached yet.
    assert pub0["published"] + pub0["unwatched"] + pub1["published"] + pub1["unwatched"] == len(stored)


HOLDER = r"""
import sys, shoal.slices
c = shoal.slices.Consumer(socket=sys.argv[1], policy="hold", hold_ms=600000, window=4, wait_s=60)
held = [c.next() for _ in range(3)]           # read, never released
print("holding", [s.slice for s in held], flush=True)
sys.stdin.read()                              # until killed
"""


def reap(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_consumer_killed_while_holding_slices_does_not_stall_the_builder(shoal_bin, tmp_path):
    before = shm_entries()
    # The builder would wait up to 10 minutes per slice for this consumer's releases. Slices
    # of 100 ms: the filter queue (64 slices) covers the time until the kill is seen.
    cfg = write_config(tmp_path, 3.0, "max_hold_ms = 600000\n", slice_ms=100)
    name = shoal.slices.socket_name(socket_template(tmp_path), 0)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    run = demo(shoal_bin, cfg, tmp_path / "out")
    try:
        line = holder.stdout.readline()
        assert line.startswith("holding"), line
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        summary, _ = run.communicate(timeout=300)
    finally:
        reap(holder, run)
    assert run.returncode == 0, (tmp_path / "out.log").read_text()[-3000:]
    s = json.loads(summary)
    assert s["ledger"]["balanced"] and s["slices_incomplete"] == 0
    b0 = s["builder_reports"][0]
    # Seen as gone, its slots freed: the filter kept up with every slice.
    assert b0["slices_not_filtered"] == 0
    c = b0["consumers"]
    assert c["attached"] == 1 and c["consumers"][0]["offered"] >= 3
    assert c["consumers"][0]["released"] == 0
    assert shm_entries() == before


def test_a_builder_killed_with_sigkill_leaves_nothing_and_the_next_run_starts_clean(shoal_bin, tmp_path):
    before = shm_entries()
    cfg = write_config(tmp_path, 600.0)
    consumer = subprocess.Popen(
        [str(shoal_bin), "consume", "--socket", socket_template(tmp_path), "--builder", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    run = demo(shoal_bin, cfg, tmp_path / "out")
    try:
        first = consumer.stdout.readline()
        assert json.loads(first)["slice"] > 0, first
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=60)
        _, err = consumer.communicate(timeout=60)
    finally:
        reap(consumer, run)
    # The consumer is told its builder went away; nothing was left behind.
    assert consumer.returncode == 1 and "went away" in err, err
    assert shm_entries() == before

    # Same names, no cleanup: the next run publishes to a new consumer.
    cfg = write_config(tmp_path, 1.0)
    again = subprocess.Popen(
        [str(shoal_bin), "consume", "--socket", socket_template(tmp_path), "--builder", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    run2 = demo(shoal_bin, cfg, tmp_path / "out2")
    summary, _ = run2.communicate(timeout=300)
    assert run2.returncode == 0, (tmp_path / "out2.log").read_text()[-3000:]
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["end"] and lines[-1]["offered"] == len(lines) - 1 >= 1
    assert json.loads(summary)["builder_reports"][0]["consumers"]["published"] == len(lines) - 1
    assert shm_entries() == before
