#!/usr/bin/env python3
"""A readout program in Python: the source SDK's documented example (docs/sdk.md), run by
`make test` (tests/python/test_sdk.py) beside the C and Rust ones.

    readout.py CONFIG.toml FIRST_SOURCE N_SOURCES SLICES SLICE_MS

CONFIG.toml is any shoal configuration whose [source] ids are the boards this program
reads and whose input_time_base is "run". Each board's fragment of each slice is
submitted with its data time, as a numpy array (no copy above 16 KiB); at the end the
program flushes, closes and prints the end-of-run report (JSON) on stdout. The payloads are
examples/c/pattern.h's.
"""
import json
import sys

import numpy as np
import shoal


def pattern(source: int, slice_: int) -> np.ndarray:
    """examples/c/pattern.h: the payload of (source, slice)."""
    n = 100 + (slice_ * 37 + source * 101) % 3000
    i = np.arange(n, dtype=np.uint64)
    return ((i ^ np.uint64(slice_ * 31) ^ np.uint64(source << 3)) & 0xFF).astype(np.uint8)


def main() -> int:
    config, first, n, slices, slice_ms = sys.argv[1], *map(int, sys.argv[2:6])
    slice_ns = slice_ms * 1_000_000
    with shoal.Source(config) as source:
        print(f"readout: run starts at slice {source.first_slice}", file=sys.stderr)
        for slice_ in range(slices):
            for board in range(first, first + n):
                t = slice_ * slice_ns + board * 1000  # the board's time of its data
                try:
                    source.submit(board, t, pattern(board, slice_))
                except shoal.Full:
                    raise  # back-pressure outlasted source.input_block_ms: shoal is too slow
                except shoal.Refused as e:
                    print(f"readout: {e}", file=sys.stderr)  # counted in the report
        if not source.flush(60.0):
            print("readout: data still on its way after 60 s", file=sys.stderr)
    # Leaving the block closed the source: the end-of-run report is there.
    print(json.dumps(source.report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
