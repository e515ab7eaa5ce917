"""Interop: the real PyPI ControlHost clients (controlhost 0.7.1, km3pipe 11.0.0) against
`shoal dispatcher`. Subscriptions are not acknowledged by the protocol, so tests wait on the
dispatcher's /status page until a subscription is in effect."""

import json
import socket
import struct
import subprocess
import time
import urllib.request

import controlhost as ch
import pytest
from km3pipe.controlhost import Client as KClient

from shoal_cluster import free_port

TIMEOUT = 15


def start_dispatcher(shoal_bin, *extra):
    """`shoal dispatcher` on free loopback ports; (process, (host, port, http port))."""
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [str(shoal_bin), "dispatcher", "--listen", f"127.0.0.1:{port}", "--http", f"127.0.0.1:{http}", *extra],
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", http), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("dispatcher did not start")
    return proc, ("127.0.0.1", port, http)


@pytest.fixture
def dispatcher(shoal_bin):
    proc, d = start_dispatcher(shoal_bin)
    yield d
    proc.terminate()
    proc.wait(timeout=10)


def status(d):
    with urllib.request.urlopen(f"http://127.0.0.1:{d[2]}/status", timeout=5) as r:
        return json.loads(r.read())


def wait_for(d, predicate, what):
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        s = status(d)
        if predicate(s):
            return s
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {status(d)}")


def subscribed(d, text, count=1):
    """Wait until `count` clients have exactly this subscription and are ready."""
    wait_for(
        d,
        lambda s: sum(c["subscription"] == text and c["ready"] != 0 for c in s["clients"]) >= count,
        f"{count} x {text!r}",
    )


def k_sub(d, tag, mode="any"):
    c = KClient(d[0], d[1])
    c.subscribe(tag, mode=mode)
    c.socket.settimeout(TIMEOUT)
    return c


def ch_pub(d, tag: bytes, payload: bytes):
    c = ch.Client(d[0], d[1])
    c._connect()
    c.socket.sendall(ch.Message(tag, payload).data)
    return c


def raw_frame(tag: bytes, payload: bytes) -> bytes:
    return tag.ljust(8, b"\0") + struct.pack(">i", len(payload)) + b"\0" * 4 + payload


def test_km3pipe_any_receives_from_controlhost_publisher(dispatcher):
    sub = k_sub(dispatcher, "MSG")
    subscribed(dispatcher, "w MSG")
    pub = ch_pub(dispatcher, b"MSG", b"hello from controlhost")
    prefix, data = sub.get_message()
    assert str(prefix.tag) == "MSG"
    assert data == b"hello from controlhost"
    pub._disconnect()
    sub._disconnect()


def test_controlhost_all_receives_from_km3pipe_publisher(dispatcher):
    sub = ch.Client(dispatcher[0], dispatcher[1])
    sub._connect()
    sub.subscribe("IO_SUM", mode="all")
    sub.socket.settimeout(TIMEOUT)
    subscribed(dispatcher, "a IO_SUM")
    pub = KClient(dispatcher[0], dispatcher[1])
    pub.put_message("IO_SUM", b"\x01\x02\x03 summary")
    msg = sub.get_message()
    assert str(msg.prefix.tag) == "IO_SUM"
    assert msg.data == b"\x01\x02\x03 summary"
    sub._disconnect()


def test_each_publishes_to_the_other(dispatcher):
    k = k_sub(dispatcher, "TO_K")
    c = ch.Client(dispatcher[0], dispatcher[1], tag="TO_C")
    c.socket.settimeout(TIMEOUT)
    subscribed(dispatcher, "w TO_K")
    subscribed(dispatcher, "w TO_C")
    k.put_message("TO_C", "from km3pipe")
    c.socket.sendall(ch.Message(b"TO_K", b"from controlhost").data)
    assert c.get_message().data == b"from km3pipe"
    assert k.get_message()[1] == b"from controlhost"


def test_multi_tag_subscription(dispatcher):
    sub = k_sub(dispatcher, "IO_EVT IO_SUM")
    subscribed(dispatcher, "w IO_EVT w IO_SUM")
    pub = KClient(*dispatcher[:2])
    pub.put_message("IO_EVT", b"evt")
    pub.put_message("IO_SUM", b"sum")
    got = [sub.get_message() for _ in range(2)]
    assert [(str(p.tag), d) for p, d in got] == [("IO_EVT", b"evt"), ("IO_SUM", b"sum")]


def test_subscribe_replaces_the_set(dispatcher):
    sub = k_sub(dispatcher, "OLD")
    sub.unsubscribe("OLD")
    sub.subscribe("NEW")
    subscribed(dispatcher, "w NEW")
    pub = KClient(*dispatcher[:2])
    pub.put_message("OLD", b"must not arrive")
    pub.put_message("NEW", b"arrives")
    prefix, data = sub.get_message()
    assert (str(prefix.tag), data) == ("NEW", b"arrives")
    s = status(dispatcher)
    assert s["tags"]["OLD"]["messages_out"] == 0


def test_one_megabyte_payload_intact(dispatcher):
    payload = bytes(range(256)) * 4096  # 1 MiB
    k = k_sub(dispatcher, "BIG")
    c = ch.Client(dispatcher[0], dispatcher[1], tag="BIG")
    c.socket.settimeout(TIMEOUT)
    subscribed(dispatcher, "w BIG", count=2)
    KClient(*dispatcher[:2]).put_message("BIG", payload)
    assert k.get_message()[1] == payload
    # controlhost 0.7.1 reads the payload with recv loops; it must get every byte too.
    assert c.get_message().data == payload


def test_fifty_concurrent_clients(dispatcher):
    subs = [k_sub(dispatcher, "FANOUT", mode="all" if i % 2 else "any") for i in range(50)]
    wait_for(dispatcher, lambda s: sum("FANOUT" in c["subscription"] for c in s["clients"]) == 50, "50 subscribers")
    pub = KClient(*dispatcher[:2])
    for i in range(3):
        pub.put_message("FANOUT", f"message {i}")
    for s in subs:
        assert [s.get_message()[1] for _ in range(3)] == [b"message 0", b"message 1", b"message 2"]
    st = status(dispatcher)
    assert st["tags"]["FANOUT"]["messages_out"] == 150
    assert st["tags"]["FANOUT"]["dropped"] == 0


def test_born_and_died_announcements(dispatcher):
    sub = KClient(*dispatcher[:2])
    sub.subscribe("Born")
    sub.subscribe("Died")
    sub.socket.settimeout(TIMEOUT)
    subscribed(dispatcher, "w Born w Died")
    raw = socket.create_connection(dispatcher[:2])
    raw.sendall(raw_frame(b"_MyId", b"JDataWriter"))
    prefix, data = sub.get_message()
    assert (str(prefix.tag), data) == ("Born", b"JDataWriter")
    wait_for(dispatcher, lambda s: any(c["nickname"] == "JDataWriter" for c in s["clients"]), "nickname")
    raw.close()
    prefix, data = sub.get_message()
    assert (str(prefix.tag), data) == ("Died", b"JDataWriter")


def test_chpump_reads_through_the_dispatcher(dispatcher):
    from km3pipe.io.ch import CHPump

    pump = CHPump(host=dispatcher[0], port=dispatcher[1], tags="IO_EVT", timeout=TIMEOUT, max_queue=10)
    try:
        subscribed(dispatcher, "w IO_EVT")
        KClient(*dispatcher[:2]).put_message("IO_EVT", b"\xde\xad\xbe\xef")
        blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
        assert str(blob["CHPrefix"].tag) == "IO_EVT"
        assert blob["CHData"] == b"\xde\xad\xbe\xef"
    finally:
        pump.finish()


def test_a_stranger_s_control_tags_are_refused_while_chpump_keeps_receiving(shoal_bin):
    """docs/security.md: on the plain ControlHost port KM3NeT's clients subscribe and publish
    data unchanged, but command tags (RC_CMD, ALERT) count only from allowed networks. Here
    only 127.0.0.2 may command, so km3pipe's client on 127.0.0.1 is the stranger."""
    from km3pipe.io.ch import CHPump

    proc, d = start_dispatcher(shoal_bin, "--control-from", "127.0.0.2/32")
    http = d[2]
    try:
        pump = CHPump(host=d[0], port=d[1], tags="IO_EVT,RC_CMD", timeout=TIMEOUT, max_queue=10)
        try:
            subscribed(d, "w IO_EVT w RC_CMD")
            stranger = KClient(*d[:2])
            stranger.put_message("RC_CMD", b"* STOP")  # what stopped a run before
            stranger.put_message("IO_EVT", b"\xde\xad\xbe\xef")
            blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
            assert str(blob["CHPrefix"].tag) == "IO_EVT", "the stranger's command must not arrive first"
            assert blob["CHData"] == b"\xde\xad\xbe\xef"
            s = wait_for(d, lambda s: s.get("commands_refused", {}).get("RC_CMD") == 1, "the refusal counted")
            assert "RC_CMD" not in {t for t, v in s["tags"].items() if v.get("messages_out", 0) > 0}
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as r:
                assert 'shoal_dispatcher_commands_refused_total{tag="RC_CMD"} 1' in r.read().decode()
            # From the allowed address the same command goes through to the pump.
            friend = socket.create_connection(d[:2], source_address=("127.0.0.2", 0), timeout=TIMEOUT)
            friend.sendall(raw_frame(b"RC_CMD", b"* START"))
            blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
            assert (str(blob["CHPrefix"].tag), blob["CHData"]) == ("RC_CMD", b"* START")
            friend.close()
        finally:
            pump.finish()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_chpump_keeps_the_plain_port_of_a_secured_dispatcher(shoal_bin, tmp_path):
    """docs/security.md, the control plane: on a secured dispatcher (`--credentials`) shoal's
    processes speak mutual TLS and KM3NeT's clients stay on the plain port, unchanged: CHPump
    subscribes and receives what a builder (a certificate with that role) publishes and what
    any plain client publishes on a tag of its own, while the plain client's forged builder
    data and commands are refused and its subscription to the commands is cut."""
    import ssl

    from km3pipe.io.ch import CHPump

    ca = tmp_path / "ca"
    for args in (
        ["ca", "init", ca, "--cluster", "interop"],
        ["ca", "issue", ca, "dispatcher", "--host", "127.0.0.1"],
        ["ca", "issue", ca, "builder0"],
    ):
        subprocess.run([str(shoal_bin), *map(str, args)], check=True, capture_output=True, timeout=60)
    proc, d = start_dispatcher(shoal_bin, "--credentials", ca)
    try:
        pump = CHPump(host=d[0], port=d[1], tags="IO_EVT,MSG,RC_CMD", timeout=TIMEOUT, max_queue=10)
        try:
            # RC_CMD is taken out of the pump's subscription; the rest stands.
            subscribed(d, "w IO_EVT w MSG")
            stranger = KClient(*d[:2])
            stranger.put_message("IO_EVT", b"forged")  # builders' data
            stranger.put_message("RC_CMD", b"* STOP")  # commands nothing here
            stranger.put_message("MSG", b"plain data")
            blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
            assert (str(blob["CHPrefix"].tag), blob["CHData"]) == ("MSG", b"plain data")
            tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca / "ca.pem"))
            tls.load_cert_chain(str(ca / "builder0.pem"), str(ca / "builder0.key"))
            with tls.wrap_socket(socket.create_connection(d[:2], timeout=TIMEOUT), server_hostname="127.0.0.1") as b:
                b.sendall(raw_frame(b"IO_EVT", b"\xde\xad\xbe\xef"))
                blob = pump.get_blob(0) if hasattr(pump, "get_blob") else pump.process({})
            assert (str(blob["CHPrefix"].tag), blob["CHData"]) == ("IO_EVT", b"\xde\xad\xbe\xef")
            s = wait_for(d, lambda s: len(s.get("refused", [])) == 3, "the refusals counted")
            refused = {(r["tag"], r["identity"], r["reason"]): r["count"] for r in s["refused"]}
            assert refused == {
                ("IO_EVT", "plain", "plain"): 1,
                ("RC_CMD", "plain", "plain"): 1,
                ("RC_CMD", "plain", "subscribe"): 1,
            }, refused
            assert s["authenticated"] == {"plain": 2, "tls": 1}, s["authenticated"]
        finally:
            pump.finish()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
