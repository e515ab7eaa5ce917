#!/usr/bin/env python3
"""Convert real KM3NeT data (PyPI km3net-testdata) into shoal's hit-table format.

    km3net_to_shoal.py timeslices  online/KM3NeT_00000267_00025291_L1.root  out.shkm
    km3net_to_shoal.py events      online/muon_cc_daqevents.root             out.shkm

Paths are relative to the km3net-testdata data folder unless they exist as given.

Hit-table format (little-endian): magic b"SHKM", version u32 = 1, kind u32 (1: time
slices, 2: events), record count u64, then records of 15 bytes:
`group u32` (slice or event index), `dom_id u32`, `channel u8`, `time_ns u32` (raw,
uncalibrated, as stored), `tot u8`, `flags u8` (bit 0: the hit is among the event's stored
triggered hits; events only).

The ROOT files hold KM3NeT's own classes. The events' hit vectors are plain arrays of
fixed-size records that uproot reads with an explicit dtype. The time slices' per-DOM
super frames are streamed member-wise (uproot 5 cannot read them), so they are decoded
here by hand: after the 6-byte object header and the frame count n (big-endian), the
members follow as arrays of n values; the frame lengths (56-byte header + 6 bytes per
hit) are the first array, the DOM ids the array at byte 12 + 44 n, and the hits of all
frames, in frame order, the last sum(6 * hits) bytes (hit time little-endian). Every
decoded hit is checked: channel < 31, time inside the 100 ms slice.
"""

import pathlib
import sys

import numpy as np

RECORD = np.dtype([("group", "<u4"), ("dom_id", "<u4"), ("channel", "u1"), ("time", "<u4"), ("tot", "u1"), ("flags", "u1")])
HIT_LE = np.dtype([("channel", "u1"), ("time", "<u4"), ("tot", "u1")])
SNAPSHOT = np.dtype([("dom_id", ">i4"), ("channel_id", "u1"), ("time", "<u4"), ("tot", "u1")])
TRIGGERED = np.dtype(
    [("dom_id", ">i4"), ("channel_id", "u1"), ("time", "<u4"), ("tot", "u1"), (" cnt", "u4"), (" vers", "u2"), ("trigger_mask", ">u8")]
)


def data_path(name: str) -> pathlib.Path:
    p = pathlib.Path(name)
    if p.exists():
        return p
    import km3net_testdata

    return pathlib.Path(km3net_testdata.data_path(name))


def write(path: pathlib.Path, kind: int, records: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(b"SHKM")
        f.write(np.array([1, kind], "<u4").tobytes())
        f.write(np.array([len(records)], "<u8").tobytes())
        f.write(records.astype(RECORD).tobytes())


def decode_superframes(blob: bytes, slice_ns: int = 100_000_000):
    """(dom_ids, hits per DOM) of one member-wise streamed vector<JDAQSuperFrame>."""
    n = int.from_bytes(blob[8:12], "big")
    length = np.frombuffer(blob, ">i4", n, 12).astype(np.int64)
    if ((length - 56) % 6 != 0).any() or (length < 56).any():
        raise ValueError("frame lengths are not 56 + 6 * hits")
    hits_per_frame = (length - 56) // 6
    dom_ids = np.frombuffer(blob, ">i4", n, 12 + 44 * n).astype(np.uint32)
    total = int(hits_per_frame.sum())
    hits = np.frombuffer(blob[len(blob) - 6 * total :], HIT_LE)
    if len(hits) and (hits["channel"].max() >= 31 or hits["time"].max() >= slice_ns):
        raise ValueError("decoded hits outside the DOM or the slice: the layout is not what this decoder expects")
    if not ((dom_ids > 800_000_000) & (dom_ids < 900_000_000)).all():
        raise ValueError("decoded DOM ids do not look like KM3NeT DOM ids")
    return dom_ids, np.split(hits, np.cumsum(hits_per_frame)[:-1])


def timeslices(src: pathlib.Path, out: pathlib.Path, stream: str = "L1") -> None:
    import uproot

    tree = uproot.open(src)[f"KM3NET_TIMESLICE_{stream}"]
    key = f"km3net_timeslice_{stream}/KM3NETDAQ::JDAQTimeslice/vector<KM3NETDAQ::JDAQSuperFrame>"
    raw = tree[key].array(
        uproot.interpretation.jagged.AsJagged(uproot.interpretation.numerical.AsDtype("u1"), header_bytes=0), library="np"
    )
    parts = []
    for s, blob in enumerate(raw):
        doms, per_dom = decode_superframes(blob.tobytes())
        for dom, h in zip(doms, per_dom):
            r = np.zeros(len(h), RECORD)
            r["group"], r["dom_id"] = s, dom
            r["channel"], r["time"], r["tot"] = h["channel"], h["time"], h["tot"]
            parts.append(r)
        print(f"slice {s}: {len(doms)} DOMs, {sum(len(h) for h in per_dom)} hits", file=sys.stderr)
    write(out, 1, np.concatenate(parts))


def events(src: pathlib.Path, out: pathlib.Path) -> None:
    import uproot

    tree = uproot.open(src)["KM3NET_EVENT"]
    interp = lambda dt: uproot.interpretation.jagged.AsJagged(uproot.interpretation.numerical.AsDtype(dt), header_bytes=10)  # noqa: E731
    snap = tree["KM3NET_EVENT/snapshotHits"].array(interp(SNAPSHOT), library="np")
    trig = tree["KM3NET_EVENT/triggeredHits"].array(interp(TRIGGERED), library="np")
    parts = []
    for e, (s, t) in enumerate(zip(snap, trig)):
        flagged = set(zip(t["dom_id"].tolist(), t["channel_id"].tolist(), t["time"].tolist()))
        r = np.zeros(len(s), RECORD)
        r["group"], r["dom_id"] = e, s["dom_id"]
        r["channel"], r["time"], r["tot"] = s["channel_id"], s["time"], s["tot"]
        r["flags"] = [int((d, c, tm) in flagged) for d, c, tm in zip(s["dom_id"].tolist(), s["channel_id"].tolist(), s["time"].tolist())]
        if r["flags"].sum() != len(t):
            raise ValueError(f"event {e}: {len(t)} triggered hits but {r['flags'].sum()} found among the snapshot hits")
        parts.append(r)
    print(f"{len(snap)} events, {sum(len(s) for s in snap)} snapshot hits, {sum(len(t) for t in trig)} triggered", file=sys.stderr)
    write(out, 2, np.concatenate(parts))


def main(argv):
    if len(argv) != 4 or argv[1] not in ("timeslices", "events"):
        print(__doc__, file=sys.stderr)
        return 2
    src, out = data_path(argv[2]), pathlib.Path(argv[3])
    (timeslices if argv[1] == "timeslices" else events)(src, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
