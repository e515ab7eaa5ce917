"""The KM3NeT chain end to end, checked with KM3NeT's own readers (issue 31).

`shoal clb-emulate` sends the CLB packets of km3net-testdata's IO_TSL1_1003.dat (moved to
now) to a source with `source.input = "clb:ADDR"`; its DataQueue makes one JDAQ superframe
per DOM and timeslice; builders assemble the timeslices, run the filter and publish what
KM3NeT's DataFilter publishes. km3pipe's CHPump receives all of it live from `shoal
dispatcher`; TimesliceParser must find the very hits of the recorded file, DOM by DOM and
timeslice by timeslice, on IO_TSL0 and IO_TSL1 (the file holds L1 hits only, so L1 keeps
them all); DAQEvent must read the events and find in them the hits the filter selected
(the events' Parquet file); DAQPump must read the DAQ files the builders wrote. A second
run sends the physics generator's hits: DAQSummaryslice must give the rates the emulator
sent, within the encoding's precision.
"""
import collections
import io
import json
import math
import pathlib
import re
import struct
import subprocess
import zlib

import km3pipe as kp
import pyarrow.parquet as pq
from km3net_testdata import data_path
from thepipe import Blob

from shoal_cluster import Cluster, free_port

TSL1 = data_path("daq/IO_TSL1_1003.dat")
TAGS = ["IO_TSL0", "IO_TSL1", "IO_TSSN", "IO_EVT", "IO_SUM"]


def parse_timeslice(raw: bytes):
    """(frame index, start ns, {dom: [(channel, time, tot)]}) by km3pipe's TimesliceParser."""
    blob = kp.io.daq.TimesliceParser().process(Blob({"RawBytes": raw}))
    info, hits = blob["TimesliceInfo"], blob["TSHits"]
    per_dom = {int(d): [] for d in blob["TimesliceFrameInfos"]}
    for dom, ch, t, tot in zip(hits.dom_id, hits.channel_id, hits.time, hits.tot):
        per_dom[int(dom)].append((int(ch), int(t), int(tot)))
    start = int(info.timestamp[0]) % 2**31 * 10**9 + int(info.nanoseconds[0])
    return int(info.frame_index[0]), start, per_dom


def recorded():
    raw, out, at = open(TSL1, "rb").read(), [], 0
    while at < len(raw):
        size = struct.unpack("<i", raw[at:at + 4])[0]
        out.append(parse_timeslice(raw[at:at + size])[2])
        at += size
    return out


def cluster_file(tmp_path, doms: list[int], clb_port: int, filter_name: str) -> str:
    state = tmp_path / "state"
    builders = [f'"127.0.0.1:{free_port()}"' for _ in range(2)]
    ids = ", ".join(str(i) for i in range(len(doms)))
    return f"""
[cluster]
name = "km3net"
dispatcher = "127.0.0.1:{free_port()}"
dispatcher_http = "127.0.0.1:{free_port()}"
state_dir = "{state}"
stats_interval_ms = 500

[[process]]
name = "writer"
role = "writer"
[[process]]
name = "builder0"
role = "builder"
ids = [0]
[[process]]
name = "builder1"
role = "builder"
ids = [1]
[[process]]
name = "dataqueue"
role = "source"
ids = [{ids}]

[config.run]
sources = {len(doms)}
builders = 2
slice_ms = 100
policy = "direct"
builder_addrs = [{", ".join(builders)}]
writer_addr = "127.0.0.1:{free_port()}"
[config.source]
input = "clb:127.0.0.1:{clb_port}"
input_latency_ms = 1000
drain_timeout_ms = 2000
[config.builder]
drain_timeout_ms = 4000
[config.builder.filter]
name = "{filter_name}"
[config.builder.filter.l1]
min_sources = 2
[config.writer]
out_dir = "{state / 'data'}"
[config.km3net]
det_id = 48
doms = [{", ".join(str(d) for d in doms)}]
"""


def run_chain(shoal_bin, tmp_path, emulate_args: list[str], doms: list[int], filter_name: str, want: int):
    """Runs the chain with the emulator; returns (sent, received {tag: [bytes]}, cluster, run)."""
    from km3pipe.io.ch import CHPump

    clb_port = free_port()
    c = Cluster(shoal_bin, tmp_path, text=cluster_file(tmp_path, doms, clb_port, filter_name))
    received = collections.defaultdict(list)
    try:
        host, port = c.dispatcher()
        c.wait(lambda s: s["state"] == "IDLE", 60, "every process to announce itself")
        c.run_command("INIT", "STANDBY")
        c.run_command("CONFIGURE", "READY")
        # "all": the dispatcher keeps every message for this client. The default "any" is best
        # effort by design: a client that lags more than 100 messages (the timeslices come in
        # bursts) loses some, counted by the dispatcher, and this test wants every one.
        pump = CHPump(host=host, port=port, tags=",".join(TAGS), timeout=60, max_queue=100000, subscription_mode="all")
        try:
            c.run_command("START", "RUNNING")
            emu = subprocess.run(
                [str(shoal_bin), "clb-emulate", *emulate_args, "--send", f"127.0.0.1:{clb_port}"],
                capture_output=True, text=True, timeout=120, check=True,
            )
            sent = json.loads(emu.stdout.strip().splitlines()[-1])
            # Every timeslice sent comes back on IO_TSL0 (one builder each).
            while len(received["IO_TSL0"]) < want:
                blob = pump.process({})
                received[str(blob["CHPrefix"].tag)].append(bytes(blob["CHData"]))
            c.run_command("STOP", "READY")
            # Everything the builders offered to the dispatcher (their run reports say how
            # much, per tag) reaches this client, though perhaps after STOP: wait for it.
            run = c.wait(lambda s: s.get("history"), 60, "the run record")["history"][0]["run"]
            record = c.state_dir / "runs" / f"run{run:06}.json"
            offered = collections.Counter()
            for r in json.loads(c.wait_file(record, 60).read_text())["reports"]:
                offered.update(((r.get("detail") or {}).get("km3net") or {}).get("offered", {}))
            while any(len(received[tag]) < n for tag, n in offered.items()):
                try:
                    blob = pump.process({})
                except StopIteration:
                    got = {tag: len(v) for tag, v in received.items()}
                    raise AssertionError(f"offered {dict(offered)}, received {got}; record {record.read_text()[:6000]}")
                received[str(blob["CHPrefix"].tag)].append(bytes(blob["CHData"]))
        finally:
            pump.finish()
        return sent, received, c, run
    except BaseException:
        assert c.close() == 0
        raise


def check_record(c, run: int, sent: dict):
    """The run record: the source's DataQueue took every packet sent, every frame complete,
    nothing refused or dropped; every fragment delivered; each builder's outputs counted."""
    record = json.loads((c.state_dir / "runs" / f"run{run:06}.json").read_text())
    assert record["ledger"]["balanced"] and record["slices_incomplete"] == 0, record["ledger"]
    details = {r["name"]: r["detail"] for r in record["reports"]}
    clb = details["dataqueue"]["clb"]
    assert clb["packets"] == clb["optical_packets"] == sent["packets"], clb
    assert clb["hits"] == sent["hits"] and clb["frames"] == sent["timeslices"] * len(sent["dom_ids"]), clb
    assert (clb["frames_incomplete"], clb["refused"], clb["dropped_by_kernel"]) == (0, {}, 0), clb
    km3 = [details[b]["km3net"] for b in ("builder0", "builder1")]
    assert sum(k["frames"] for k in km3) == clb["frames"] and not any(k["bad_frames"] for k in km3)
    assert all(details[b]["tap"]["dropped"] == 0 for b in ("builder0", "builder1"))


def test_recorded_timeslices_round_trip_through_the_chain_and_km3pipe_reads_every_output(shoal_bin, tmp_path):
    want = recorded()
    doms = sorted({d for ts in want for d in ts})
    sent, received, c, run = run_chain(shoal_bin, tmp_path, ["--timeslices", TSL1], doms, "l1", len(want))
    try:
        assert sent["timeslices"] == len(want)
        first, slice_ns = sent["first_timeslice_ns"], sent["slice_ns"]
        for tag in ("IO_TSL0", "IO_TSL1"):
            got = {}
            for raw in received[tag]:
                index, start, per_dom = parse_timeslice(raw)
                i = (start - first) // slice_ns
                assert 0 <= i < len(want) and (start - first) % slice_ns == 0, (tag, start, first)
                got[i] = per_dom
            assert sorted(got) == list(range(len(want))), tag
            for i, ts in enumerate(want):
                assert got[i] == ts, (tag, i)
        # Events: km3pipe's DAQEvent reads each; their hits are the filter's selection.
        events = []
        for raw in received["IO_EVT"]:
            f = io.BytesIO(raw)
            kp.io.daq.DAQPreamble(file_obj=f)
            e = kp.io.daq.DAQEvent(file_obj=f)
            assert e.header.det_id == 48 and e.n_snapshot_hits > 0 and e.n_triggered_hits > 0
            assert set(e.snapshot_hits.dom_id) <= set(doms)
            events.append(e)
        assert events, "the l1 filter selects events in this data"
        # The very events the writer stored (Parquet): the same hits, the same triggered ones.
        table = pq.read_table(c.state_dir / "data" / f"run{run:06}.events.parquet", columns=["hits"])
        stored = sorted(
            sorted((doms[h["source"]], h["channel"], h["time_ns"], h["amplitude"], h["triggered"]) for h in hits)
            for hits in table.column("hits").to_pylist()
        )

        def rows(hits):
            return [(int(d), int(ch), int(t), int(tot)) for d, ch, t, tot in zip(hits.dom_id, hits.channel_id, hits.time, hits.tot)]

        published = []
        for e in events:
            triggered = rows(e.triggered_hits)
            published.append(sorted([(*h, h in triggered) for h in rows(e.snapshot_hits)]))
        assert sorted(published) == stored
        # DAQ files: DAQPump reads the events and summaryslices the builders wrote.
        files = sorted((c.state_dir / "data").glob(f"run{run:06}.builder*.IO_EVT.dat"))
        assert files
        n = 0
        for path in files:
            pump = kp.io.daq.DAQPump(filename=str(path))
            n += len(pump)
            for blob in pump:
                assert blob["DAQEvent"].n_snapshot_hits > 0
        assert n == len(events)
        check_record(c, run, sent)
    finally:
        assert c.close() == 0


def test_summaryslices_give_the_rates_the_emulator_sent(shoal_bin, tmp_path):
    """The physics generator's K-40 hits at KM3NeT's rates through the chain: the rates
    km3pipe's DAQSummaryslice reads on IO_SUM are the hits km3pipe's CLBPump reads in the
    emulator's dump, per PMT and timeslice, within the one-byte encoding's precision."""
    dump = tmp_path / "sent.dqd"
    probe = subprocess.run(
        [str(shoal_bin), "clb-emulate", "--physics", "--lines", "1", "--doms-per-line", "3", "--seconds", "0.3",
         "--dump", str(tmp_path / "probe.dqd")],
        capture_output=True, text=True, timeout=60, check=True,
    )
    doms = json.loads(probe.stdout.strip().splitlines()[-1])["dom_ids"]
    args = ["--physics", "--lines", "1", "--doms-per-line", "3", "--seconds", "0.3", "--dump", str(dump)]
    sent, received, c, run = run_chain(shoal_bin, tmp_path, args, doms, "l1", 3)
    try:
        counts = collections.Counter()
        for blob in kp.io.clb.CLBPump(file=str(dump)):
            info, hits = blob["PacketInfo"], blob["Hits"]
            start = int(info.timestamp[0]) * 10**9 + int(info.ns_ticks[0]) * 16
            for ch in hits.channel_id:
                counts[(start, int(info.dom_id[0]), int(ch))] += 1
        assert counts, "the generator sent hits"
        summaries = 0
        for raw in received["IO_SUM"]:
            f = io.BytesIO(raw)
            kp.io.daq.DAQPreamble(file_obj=f)
            s = kp.io.daq.DAQSummaryslice(file_obj=f)
            start = s.header.time_stamp * 10**9 + s.header.ticks * 16
            assert sorted(s.summary_frames) == sorted(doms)
            for dom, rates in s.summary_frames.items():
                for ch, rate in enumerate(rates):
                    sent_hz = counts[(start, dom, ch)] / (sent["slice_ns"] * 1e-9)
                    assert sent_hz > 2e3, "K-40 alone is about 7 kHz per PMT"
                    assert math.isclose(rate, sent_hz, rel_tol=0.014), (dom, ch, rate, sent_hz)
            summaries += 1
        assert summaries == sent["timeslices"] == 3
        check_record(c, run, sent)
    finally:
        assert c.close() == 0


def test_demo_km3net_runs_the_chain_and_its_files_read_with_daqpump(shoal_bin, tmp_path):
    """`shoal demo --detector km3net`: emulated CLB packets to IO_* messages and DAQ files,
    its ledger balanced, every packet that arrived accounted, every message published
    either received by the demo's subscriber or counted dropped, the files readable."""
    out = tmp_path / "out"
    r = subprocess.run(
        [str(shoal_bin), "demo", "--detector", "km3net", "--doms-per-line", "6", "--seconds", "2", "--out", str(out),
         "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ledger"]["balanced"] and s["ledger"]["produced"] == 6 * 20, s["ledger"]
    clb, km3, demo = s["clb"], s["km3net"], s["km3net_demo"]
    assert clb["packets"] == clb["optical_packets"] + sum(clb["refused"].values()) > 0
    assert clb["packets"] + clb["dropped_by_kernel"] <= demo["emulated_packets"]
    assert km3["frames"] == clb["frames"] and km3["bad_frames"] == 0
    tap = s["builder_reports"][0]["tap"]
    offered = sum(km3["offered"].values())
    received = sum(n for n, _ in demo["received"].values())
    # (The tap also carries SHL_EVT and SHL_RAW; its drops, if any, are of either.)
    assert offered - tap["dropped"] - tap["failed"] <= received <= offered, (received, offered, tap)
    # The DAQ files: DAQPump reads every event and summaryslice the builders wrote.
    for tag, kind in (("IO_EVT", "DAQEvent"), ("IO_SUM", "DAQSummaryslice")):
        n = 0
        for path in sorted(out.glob(f"run000001.builder*.{tag}.dat")):
            objects = 0
            for blob in kp.io.daq.DAQPump(filename=str(path)):
                assert blob[kind] is not None
                objects += 1
            n += objects
            # Its metadata beside it: the size and adler32 computed while it was written
            # are the file's (zlib's adler32 over what DAQPump just read).
            meta = json.loads(path.with_name(path.name + ".json").read_text())
            data = path.read_bytes()
            assert meta["file_size"] == len(data), meta
            assert meta["checksum"] == f"adler32:{zlib.adler32(data):08x}", meta
            assert meta["events"] == objects and meta["file_format"] == "km3net-daq", meta
        assert n == km3["offered"].get(tag, 0), tag
    assert km3["offered"]["IO_SUM"] == km3["timeslices"] > 0
    # L2 hits are L1 hits, L1 hits are hits: per DOM and timeslice, in the builders' files.
    levels = {}
    for tag in ("IO_TSL0", "IO_TSL1", "IO_TSL2"):
        for path in sorted(out.glob(f"run000001.builder*.{tag}.dat")):
            raw, at = path.read_bytes(), 0
            while at < len(raw):
                size = struct.unpack("<i", raw[at:at + 4])[0]
                index, _, per_dom = parse_timeslice(raw[at:at + size])
                levels[(tag, index)] = per_dom
                at += size
    indexes = {i for (t, i) in levels if t == "IO_TSL0"}
    assert len(indexes) == km3["timeslices"] and {i for (t, i) in levels if t == "IO_TSL2"} == indexes
    l1_total = l2_total = 0
    for i in indexes:
        for dom, l0 in levels[("IO_TSL0", i)].items():
            l1, l2 = levels[("IO_TSL1", i)][dom], levels[("IO_TSL2", i)][dom]
            assert set(l2) <= set(l1) <= set(l0)
            l1_total, l2_total = l1_total + len(l1), l2_total + len(l2)
    assert 0 < l2_total < l1_total, (l2_total, l1_total)


def test_the_arca_block_example_runs_under_run_control(shoal_bin, tmp_path):
    """examples/km3net-arca-block.toml under `shoal run` (its ports moved to free ones):
    the emulator's two blocks of DOMs reach their own DataQueue process, every frame reaches
    a builder, the ledger balances."""
    from shoal_cluster import on_free_ports

    root = pathlib.Path(__file__).resolve().parents[2]
    detx = root / "examples" / "km3net-block.detx"
    text = on_free_ports((root / "examples" / "km3net-arca-block.toml").read_text())
    text = text.replace('"examples/km3net-block.detx"', f'"{detx}"')
    text = text.replace('state_dir = "shoal-runs"', f'state_dir = "{tmp_path / "state"}"')
    text = text.replace('out_dir = "shoal-runs/data"', f'out_dir = "{tmp_path / "state" / "data"}"')
    ports = re.findall(r'input = "clb:(127\.0\.0\.1:\d+)"', text)
    assert len(ports) == 2
    c = Cluster(shoal_bin, tmp_path, text=text)
    try:
        c.wait(lambda s: s["state"] == "IDLE", 60, "every process to announce itself")
        c.run_command("INIT", "STANDBY")
        c.run_command("CONFIGURE", "READY")
        from km3pipe.io.ch import CHPump

        host, port = c.dispatcher()
        pump = CHPump(host=host, port=port, tags="IO_TSL0", timeout=60, max_queue=1000)
        try:
            c.run_command("START", "RUNNING")
            emu = subprocess.run(
                [str(shoal_bin), "clb-emulate", "--physics", "--detx", str(detx), "--seconds", "0.5",
                 "--send", ",".join(ports)],
                capture_output=True, text=True, timeout=120, check=True,
            )
            sent = json.loads(emu.stdout.strip().splitlines()[-1])
            # Every emulated timeslice built: one IO_TSL0 each, all 36 DOMs in it.
            for _ in range(sent["timeslices"]):
                _, _, per_dom = parse_timeslice(bytes(pump.process({})["CHData"]))
                assert len(per_dom) == 36
        finally:
            pump.finish()
        c.run_command("STOP", "READY")
        run = c.status()["history"][0]["run"]
        record = json.loads((c.state_dir / "runs" / f"run{run:06}.json").read_text())
        assert record["ledger"]["balanced"], record["ledger"]
        details = {r["name"]: r["detail"] for r in record["reports"]}
        queues = [details[f"dataqueue{q}"]["clb"] for q in range(2)]
        for q in queues:
            assert q["packets"] > 0 and "unknown_dom" not in q["refused"], q
        assert sum(q["packets"] + q["dropped_by_kernel"] for q in queues) <= sent["packets"]
        built = sum(details[f"datafilter{b}"]["km3net"]["frames"] for b in range(3))
        assert built == sum(q["frames"] for q in queues) == 36 * sent["timeslices"]
    finally:
        assert c.close() == 0
