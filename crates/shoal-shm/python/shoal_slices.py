"""shoal's shared-memory slice consumer, in Python (docs/plugins.md, "Slice consumers").

A builder with ``[builder.consumers] enabled = true`` publishes every filtered slice into a
ring in a memfd. This module attaches to it (an abstract ``SOCK_SEQPACKET`` socket; the memfd
arrives with ``SCM_RIGHTS``), maps the ring read-only and hands out each slice's fragments as
``memoryview`` objects into the mapping and hits as numpy structured arrays over the same
bytes: nothing is copied.

    from shoal.slices import Consumer
    with Consumer(builder=0, socket="shoal/b{builder}") as c:
        for s in c:                   # until the run ends
            for f in s.fragments:     # f.payload: memoryview into the ring
                hits = s.hits(f)      # numpy view: channel, time_ns, amplitude
            s.release()               # True: nothing was overwritten while read
        print(c.end)                  # offered, skipped, overrun

The same file is embedded in the ``shoal`` Python module (as ``shoal.slices``) and in the
builder's Python filter workers; it needs only the standard library (numpy for ``hits``).
"""

import mmap
import os
import socket
import struct
import time

MSG = struct.Struct("<II5Q")
MSG_LEN = MSG.size  # 48
VERSION = 1
HELLO, WELCOME, SLICE, RELEASE, END = 1, 2, 3, 4, 5
# Python filter workers (builder.filter.python): the builder sends SLICE, the worker
# answers DONE (events in its results memfd) or FAILED (the filter raised).
DONE, FAILED = 6, 7
WORKER_HELLO_POLICY = 2
SLOT = struct.Struct("<IHHII6Q")  # magic, version, reserved, fragments, reserved, 6 x u64
SLOT_MAGIC = int.from_bytes(b"SLCE", "little")
ENTRY = struct.Struct("<IHHIIQQ")  # source, flags, reserved, hit_count, reserved, offset, len
RECLAIMED_BELOW_AT = 32
HIT_LEN = 6


class RingError(Exception):
    """The builder sent something this client does not understand, or went away."""


def hit_dtype():
    import numpy as np

    return np.dtype([("channel", "u1"), ("time_ns", "<u4"), ("amplitude", "u1")])


def event_hit_dtype():
    """One hit of a selected event, as a Python filter returns it (12 bytes)."""
    import numpy as np

    return np.dtype(
        [("source", "<u4"), ("time_ns", "<u4"), ("channel", "u1"), ("amplitude", "u1"), ("triggered", "u1"), ("reserved", "u1")]
    )


def socket_name(template, builder):
    return (template or "shoal/b{builder}").replace("{builder}", str(builder))


def send(sock, kind, a=0, b=0, c=0, d=0, e=0):
    sock.send(MSG.pack(kind, VERSION, a, b, c, d, e))


def recv(sock):
    """One message as (kind, fields, fds); kind None when the peer closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MSG_LEN + 1, 1)
    if not data:
        return None, (), fds
    if len(data) != MSG_LEN:
        raise RingError(f"message of {len(data)} bytes, expected {MSG_LEN}")
    kind, version, *fields = MSG.unpack(data)
    if version != VERSION:
        raise RingError(f"protocol version {version}, this client speaks {VERSION}")
    return kind, fields, fds


class Fragment:
    __slots__ = ("source", "flags", "hit_count", "payload")

    def __init__(self, source, flags, hit_count, payload):
        self.source, self.flags, self.hit_count, self.payload = source, flags, hit_count, payload

    def __repr__(self):
        return f"Fragment(source={self.source}, flags={self.flags:#x}, hits={self.hit_count}, bytes={len(self.payload)})"


class Slice:
    """One slice in the ring, read in place; valid until released."""

    def __init__(self, ring, seq, start, length):
        self._ring, self.seq, self._start, self._len = ring, seq, start, length
        view = ring.view
        magic, version, _r, nfrag, _r2, seq2, slice_, start_ns, slice_ns, _slot_len, _payload = SLOT.unpack_from(view, start)
        if magic != SLOT_MAGIC or version != VERSION or seq2 != seq:
            raise RingError("not the announced slot")
        if 64 + nfrag * ENTRY.size > length:
            raise RingError("fragment table outside its slot")
        self.slice, self.slice_start_ns, self.slice_ns = slice_, start_ns, slice_ns
        self.fragments = []
        for i in range(nfrag):
            source, flags, _r, hit_count, _r2, off, n = ENTRY.unpack_from(view, start + 64 + i * ENTRY.size)
            if off + n > length:
                raise RingError("fragment outside its slot")
            self.fragments.append(Fragment(source, flags, hit_count, view[start + off : start + off + n]))
        self.released = False

    def hits(self, fragment):
        """The fragment's hits as a numpy structured array over the ring's bytes (no copy)."""
        import numpy as np

        return np.frombuffer(fragment.payload, dtype=hit_dtype(), count=fragment.hit_count)

    def bytes(self):
        """The whole slot (header, fragment table, payloads) as a memoryview."""
        return self._ring.view[self._start : self._start + self._len]

    def intact(self):
        """True while no byte of this slot has been reused (check after reading)."""
        return self._ring.reclaimed_below() <= self.seq

    def release(self):
        """Done with the slice; returns whether it stayed intact until now."""
        if self.released:
            return True
        intact = self.intact()
        self.released = True
        self.fragments = []
        self._ring.release(self.seq)
        return intact

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class _Ring:
    def __init__(self, sock, fd, length):
        self.sock = sock
        self.map = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        self.view = memoryview(self.map)
        if self.view[0:8].tobytes() != b"SHOALRNG":
            raise RingError("not a shoal slice ring")

    def reclaimed_below(self):
        # An aligned 8-byte load (atomic on the platforms shoal runs on).
        return self.view[RECLAIMED_BELOW_AT : RECLAIMED_BELOW_AT + 8].cast("Q")[0]

    def release(self, seq):
        try:
            send(self.sock, RELEASE, seq)
        except OSError:
            pass  # the builder is gone: not the consumer's error


class Consumer:
    """Attaches to builder ``builder``'s slice ring.

    policy: ``"skip"`` (never waited for; slices past ``window`` held are skipped, counted)
    or ``"hold"`` (the builder waits up to ``hold_ms`` per slice for the release).
    """

    def __init__(self, builder=0, socket=None, policy="skip", hold_ms=1000, window=4, wait_s=30.0):
        name = socket_name(socket, builder)
        if policy not in ("skip", "hold"):
            raise ValueError(f"policy {policy!r}: expected 'skip' or 'hold'")
        deadline = time.monotonic() + wait_s
        while True:
            s = _socket_module.socket(_socket_module.AF_UNIX, _socket_module.SOCK_SEQPACKET)
            try:
                s.connect("\0" + name)
                break
            except OSError:
                s.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        self.sock = s
        send(s, HELLO, 0 if policy == "hold" else 1, hold_ms, max(1, window))
        kind, fields, fds = recv(s)
        if kind != WELCOME or not fds:
            s.close()
            raise RingError("the builder refused (too many consumers?)" if kind is None else "no welcome")
        self.run, self.builder, length = fields[0], fields[1], fields[2]
        self.ring = _Ring(s, fds[0], length)
        for extra in fds[1:]:
            os.close(extra)
        self.end = None
        self.lost_before_read = 0

    def next(self, timeout=None):
        """The next Slice; None at the end of the run (``self.end`` then holds the counters)
        or when ``timeout`` seconds pass (``self.end`` still None)."""
        while True:
            self.sock.settimeout(timeout)
            try:
                kind, f, fds = recv(self.sock)
            except TimeoutError:
                return None
            finally:
                self.sock.settimeout(None)
            for fd in fds:
                os.close(fd)
            if kind == SLICE:
                seq, offset, length = f[0], f[1], f[2]
                if self.ring.reclaimed_below() > seq:
                    # Taken back before we got to it (the builder counted an overrun).
                    self.ring.release(seq)
                    self.lost_before_read += 1
                    continue
                return Slice(self.ring, seq, offset, length)
            if kind == END:
                self.end = {"offered": f[0], "skipped": f[1], "overrun": f[2], "lost_before_read": self.lost_before_read}
                return None
            if kind is None:
                raise RingError("the builder closed the slice socket")
            raise RingError(f"unexpected message kind {kind}")

    def __iter__(self):
        while True:
            s = self.next()
            if s is None:
                return
            yield s

    def close(self):
        # Views handed out keep the mapping alive; the socket goes now.
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_socket_module = socket


class _Inbox:
    """A worker's inbox: one slot at a time, never reclaimed while it is being read."""

    def __init__(self, fd):
        self.map = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        self.view = memoryview(self.map)

    def reclaimed_below(self):
        return 0

    def release(self, seq):
        pass


def _as_event(item, dtype):
    """(trigger_mask, hits) from what a filter returned: a hits array, or (mask, hits)."""
    import numpy as np

    mask, hits = (item if isinstance(item, tuple) else (1, item))
    hits = np.asarray(hits)
    if hits.dtype != dtype:
        # Any structured array with the same field names will do.
        out = np.zeros(len(hits), dtype=dtype)
        for name in ("source", "time_ns", "channel", "amplitude", "triggered"):
            if hits.dtype.names and name in hits.dtype.names:
                out[name] = hits[name]
        hits = out
    return int(mask), hits


class _Results:
    """The worker's results memfd: events written in place, grown by a new memfd."""

    def __init__(self):
        self.fd, self.map, self.fresh = None, None, False

    def ensure(self, size):
        if self.map is not None and len(self.map) >= size:
            return
        n = 1 << max(20, (size - 1).bit_length())
        fd = os.memfd_create("shoal-events", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.map, self.fresh = fd, mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), True

    def write(self, events):
        import numpy as np

        dtype = event_hit_dtype()
        evs = [_as_event(e, dtype) for e in events]
        size = sum(8 + dtype.itemsize * len(h) for _, h in evs)
        self.ensure(max(size, 1))
        at = 0
        for mask, hits in evs:
            struct.pack_into("<II", self.map, at, mask & 0xFFFFFFFF, len(hits))
            if len(hits):
                np.frombuffer(self.map, dtype=dtype, count=len(hits), offset=at + 8)[:] = hits
            at += 8 + dtype.itemsize * len(hits)
        return len(evs), size


def worker_main():
    """A Python filter worker, started by its builder: ``python -c <this file> module:function
    python_path config``, its socket as fd 3. Imports the module, calls its ``init(config)``
    if it has one, then filters slice after slice until the builder says the run ended."""
    import importlib
    import sys
    import traceback

    target, path, config = sys.argv[1], sys.argv[2], sys.argv[3]
    sock = _socket_module.socket(fileno=3)
    # This very file (the builder's own version) is `shoal.slices` for the filter's imports,
    # whether or not a `shoal` package is installed in this interpreter.
    me = sys.modules["__main__"]
    try:
        import shoal as package
    except ImportError:
        import types

        package = types.ModuleType("shoal")
        sys.modules["shoal"] = package
    package.slices = me
    sys.modules["shoal.slices"] = me
    for p in reversed([p for p in path.split(os.pathsep) if p]):
        sys.path.insert(0, p)
    module_name, _, function_name = target.partition(":")
    module = importlib.import_module(module_name)
    function = getattr(module, function_name)
    if hasattr(module, "init"):
        module.init(config)
    send(sock, HELLO, WORKER_HELLO_POLICY)
    inbox, results = None, _Results()
    while True:
        kind, f, fds = recv(sock)
        if kind is None or kind == END:
            return
        if fds:
            inbox = _Inbox(fds[0])
            for extra in fds[1:]:
                os.close(extra)
        if kind != SLICE or inbox is None:
            raise RingError(f"unexpected message kind {kind}")
        seq, offset, length = f[0], f[1], f[2]
        try:
            n, size = results.write(function(Slice(inbox, seq, offset, length)))
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            send(sock, FAILED, seq)
            continue
        if results.fresh:
            results.fresh = False
            sock.sendmsg([MSG.pack(DONE, VERSION, seq, n, size, 0, 0)], [(_socket_module.SOL_SOCKET, _socket_module.SCM_RIGHTS, struct.pack("i", results.fd))])
        else:
            send(sock, DONE, seq, n, size)
