"""KM3NeT's formats checked with KM3NeT's own readers (issue 31, first part).

`shoal clb-emulate` turns a recorded timeslice file of km3net-testdata (IO_TSL1_1003.dat)
into CLB optical packets; km3pipe's CLBPump must read the dump and find every hit of every
DOM. `shoal clb-assemble` puts the packets back together through shoal's DataQueue into
JDAQTimeslices; km3pipe's TimesliceParser must read them and find the very hits the
original file holds, DOM by DOM and timeslice by timeslice.
"""
import collections
import pathlib
import struct
import subprocess

import km3pipe as kp
from km3net_testdata import data_path
from thepipe import Blob

TSL1 = pathlib.Path(data_path("daq/IO_TSL1_1003.dat"))


def timeslices(path: pathlib.Path):
    """Every timeslice of a file through km3pipe's TimesliceParser: {(seconds, dom): hits}."""
    parser = kp.io.daq.TimesliceParser()
    raw, out, at = path.read_bytes(), {}, 0
    while at < len(raw):
        size = struct.unpack("<i", raw[at:at + 4])[0]
        blob = parser.process(Blob({"RawBytes": raw[at:at + size]}))
        info, hits = blob["TimesliceInfo"], blob["TSHits"]
        seconds = int(info.timestamp[0])
        per_dom = collections.defaultdict(list)
        for dom, ch, t, tot in zip(hits.dom_id, hits.channel_id, hits.time, hits.tot):
            per_dom[int(dom)].append((int(ch), int(t), int(tot)))
        for dom, frame in blob["TimesliceFrameInfos"].items():
            out[(seconds, int(dom))] = per_dom.get(int(dom), [])
        at += size
    return out


def test_clb_packets_of_a_recorded_timeslice_file_read_by_clbpump_and_reassembled(shoal_bin, tmp_path):
    dump, back = tmp_path / "emulated.dqd", tmp_path / "assembled.dat"
    r = subprocess.run([str(shoal_bin), "clb-emulate", "--timeslices", str(TSL1), "--dump", str(dump),
                        "--hits-per-packet", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    original = timeslices(TSL1)
    assert sum(len(h) for h in original.values()) > 1000, "the sample has hits to compare"

    # km3pipe's CLBPump reads what the emulator sends.
    from_clb = collections.defaultdict(list)
    packets = 0
    for blob in kp.io.clb.CLBPump(file=str(dump)):
        info, hits = blob["PacketInfo"], blob["Hits"]
        assert info.data_type[0] == "TTDC"
        key = (int(info.timestamp[0]), int(info.dom_id[0]))
        from_clb[key] += [(int(c), int(t), int(o)) for c, t, o in zip(hits.channel_id, hits.time, hits.tot)]
        packets += 1
    assert packets > len(original), "frames of more than 64 hits span several packets"
    assert {k: v for k, v in from_clb.items() if v} == {k: v for k, v in original.items() if v}

    # Back through the DataQueue: the same hits, DOM by DOM.
    r = subprocess.run([str(shoal_bin), "clb-assemble", "--dump", str(dump), "--out", str(back),
                        "--det-id", "48", "--data-type", "1003"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert timeslices(back) == original


def test_a_damaged_dump_is_counted_not_fatal(shoal_bin, tmp_path):
    dump, back = tmp_path / "emulated.dqd", tmp_path / "assembled.dat"
    subprocess.run([str(shoal_bin), "clb-emulate", "--timeslices", str(TSL1), "--dump", str(dump)], check=True,
                   capture_output=True, timeout=120)
    raw = bytearray(dump.read_bytes())
    n = struct.unpack("<I", raw[:4])[0]
    raw[4:8] = b"XXXX"                                  # the first packet of an unknown type
    raw += struct.pack("<I", 10) + b"TTDC" + bytes(6)   # a packet too short for its header
    raw += struct.pack("<I", 1000) + bytes(20)          # a record running past the end
    dump.write_bytes(bytes(raw))
    r = subprocess.run([str(shoal_bin), "clb-assemble", "--dump", str(dump), "--out", str(back)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, "damage is reported in the exit status"
    import json
    report = json.loads(r.stdout)
    assert report["refused"] == {"unknown_type": 1, "short": 1}, report
    assert "runs past the end" in r.stderr
    # Every other packet still made its frame.
    assert report["optical_packets"] == report["packets"] - 2 and n > 0
    assert timeslices(back), "the rest was assembled"


def test_shoal_codecs_reencode_km3nets_sample_files_bit_for_bit(shoal_bin):
    """Every event, summaryslice and timeslice of km3net-testdata's DAQ files, decoded by
    shoal and encoded again, gives the very bytes of the file."""
    files = [pathlib.Path(data_path(f"daq/{n}")) for n in ("IO_EVT.dat", "IO_SUM.dat", "IO_TSSN.dat", "IO_TSL1_1003.dat")]
    r = subprocess.run([str(shoal_bin), "jdaq-check", *map(str, files)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    found = [json.loads(line) for line in r.stdout.splitlines()]
    assert [f["identical"] for f in found] == [{"event": 3}, {"summaryslice": 3}, {"timeslice": 3}, {"timeslice": 10}]
    # And a damaged one is named, not passed.
    bad = bytearray(files[0].read_bytes())
    bad[8] = 9  # the first event's version
    damaged = pathlib.Path(files[0].name)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        damaged = pathlib.Path(d) / "IO_EVT.dat"
        damaged.write_bytes(bytes(bad))
        r = subprocess.run([str(shoal_bin), "jdaq-check", str(damaged)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "unsupported" in r.stdout.lower() or "version" in r.stdout, r.stdout
