"""Monitoring taps under `shoal run`: km3pipe's CHPump reads the builders' selected events
from the dispatcher (tag SHL_EVT), the PyPI controlhost client reads a sampled raw slice
(tag SHL_RAW); both decode with the documented formats (docs/wire-format.md), and the tapped
events are exactly the ones the writer stored for those slices."""

import re
import struct
import urllib.request

import controlhost as ch
import pyarrow.parquet as pq
from shoal_cluster import Cluster

HEADER = struct.Struct("<4sBBHIIQQQIIII")  # 56 bytes, docs/wire-format.md
EVENTS, BURST = 1 << 3, 1 << 2


def frames(data: bytes):
    """Yields (header fields, payload) for each frame in `data`."""
    at = 0
    while at < len(data):
        magic, version, hlen, flags, source, hit_count, slice_, start, sent, plen, pcrc, res, hcrc = HEADER.unpack_from(
            data, at
        )
        assert (magic, version, hlen, res) == (b"SHLF", 1, 56, 0)
        payload = data[at + 56 : at + 56 + plen]
        assert len(payload) == plen
        yield dict(flags=flags, source=source, hit_count=hit_count, slice=slice_), payload
        at += 56 + plen


def decode_events(payload: bytes) -> list[int]:
    """Event ids of an EVENTS payload; checks that the records fill it exactly."""
    ids, at = [], 0
    while at < len(payload):
        event_id, _mask, _overlays, n_hits = struct.unpack_from("<IIII", payload, at)
        at += 16 + 11 * n_hits
        ids.append(event_id)
    assert at == len(payload)
    return ids


def test_taps_publish_events_and_raw_slices(shoal_bin, tmp_path):
    from km3pipe.io.ch import CHPump

    c = Cluster(shoal_bin, tmp_path)
    try:
        host, port = re.search(r'^dispatcher = "([\d.]+):(\d+)"', c.file.read_text(), re.M).groups()
        c.wait(lambda s: s["state"] == "IDLE", 60, "every process to announce itself")
        c.run_command("INIT", "STANDBY")
        c.run_command("CONFIGURE", "READY")
        raw_sub = ch.Client(host, int(port))
        raw_sub._connect()
        raw_sub.subscribe("SHL_RAW", mode="wait")
        raw_sub.socket.settimeout(30)
        pump = CHPump(host=host, port=int(port), tags="SHL_EVT", timeout=30, max_queue=1000)
        try:
            c.run_command("START", "RUNNING")
            tapped = {}
            for _ in range(60):
                blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
                assert str(blob["CHPrefix"].tag) == "SHL_EVT"
                ((h, payload),) = list(frames(blob["CHData"]))
                assert h["flags"] == EVENTS
                tapped[(h["source"], h["slice"])] = decode_events(payload)
            raw = raw_sub.get_message()
            assert str(raw.prefix.tag) == "SHL_RAW"
            fragments = list(frames(raw.data))
        finally:
            pump.finish()
            raw_sub._disconnect()
        # A sampled raw slice: one data frame per source, all of one slice, hits then waveforms.
        assert sorted(h["source"] for h, _ in fragments) == list(range(5))
        assert len({h["slice"] for h, _ in fragments}) == 1
        for h, payload in fragments:
            assert h["flags"] & ~BURST == 0, "generated hits: at most the burst flag"
            assert (len(payload) - 6 * h["hit_count"]) % 263 == 0
        # Prometheus shows the taps and the saver's memory on every builder.
        s = c.status()
        builder = c.process(s, "builder0")
        with urllib.request.urlopen(f"http://{builder['metrics_addr']}/metrics", timeout=10) as r:
            metrics = dict(
                line.rsplit(" ", 1) for line in r.read().decode().splitlines() if line and not line.startswith("#")
            )
        value = lambda name: float(next(v for k, v in metrics.items() if k.startswith(name + "{")))  # noqa: E731
        assert value("shoal_node_tap_published_total") > 0, metrics
        assert value("shoal_node_saver_bytes") > 0, metrics
        assert value("shoal_node_page_faults_total") > 0, metrics
        c.run_command("STOP", "READY")
        s = c.status()
        run = s["history"][0]["run"]
        table = pq.read_table(c.state_dir / "data" / f"run{run:06}.events.parquet", columns=["builder", "slice", "event_id"])
        stored = {}
        for b, sl, e in zip(*(table.column(n).to_pylist() for n in ("builder", "slice", "event_id"))):
            stored.setdefault((b, sl), []).append(e)
        assert len(tapped) == 60
        for key, ids in tapped.items():
            assert sorted(stored.get(key, [])) == sorted(ids), key
    finally:
        assert c.close() == 0
