#!/usr/bin/env python3
"""What the control plane's mutual TLS costs (docs/benchmarks.md, "Security"): one secured
dispatcher (`shoal dispatcher --credentials`, as run control starts it whenever
`[cluster.security]` is set), and the same publisher and subscribers (`pubsub-bench`, the
dispatcher's own pub/sub benchmark) reaching it in plain ControlHost and over mutual TLS,
in turn, case by case and round by round (the first mode of each round moves along).

The cases are the control plane's traffic and beyond it: 100-byte messages to one and to
ten subscribers (commands, replies, statistics), 10 kB to one (a builder's statistics at
full shape) and to ten. Prints, per case and mode, the median messages/s and the
dispatcher's CPU microseconds per message delivered, and their ratios TLS / plain; the
handshake a process makes once is `tls-bench handshakes` (security_cost.py).

usage: scripts/control_tls_cost.py [--bin target/release/shoal] [--rounds 3]
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_ab import arg, wait_listening  # noqa: E402

CASES = [(1, 100), (10, 100), (1, 10_000), (10, 10_000)]
MODES = ["plain", "tls"]


def cpu_seconds(pid):
    """User and system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    binary = os.path.abspath(arg("--bin", "target/release/shoal"))
    bench = os.path.join(os.path.dirname(binary), "pubsub-bench")
    rounds = int(arg("--rounds", "3"))
    tmp = tempfile.mkdtemp(prefix="control-tls-cost-")
    ca = os.path.join(tmp, "ca")
    for cmd in (["ca", "init", ca, "--cluster", "bench"], ["ca", "issue", ca, "dispatcher", "--host", "127.0.0.1"]):
        subprocess.run([binary, *cmd], check=True, capture_output=True)
    port = free_port()
    log = open(os.path.join(tmp, "dispatcher.log"), "w")
    d = subprocess.Popen([binary, "dispatcher", "--listen", f"127.0.0.1:{port}", "--http", "off",
                          "--credentials", ca, "--queue-limit", "1000"], stdout=log, stderr=log,
                         stdin=subprocess.DEVNULL)
    try:
        wait_listening(port)
        got = {(c, m): [] for c in CASES for m in MODES}
        for r in range(rounds):
            for case in CASES:
                order = MODES[r % 2:] + MODES[:r % 2]
                for m in order:
                    subs, payload = case
                    cmd = [bench, "--target", "shoal", "--addr", f"127.0.0.1:{port}", "--subscribers", str(subs),
                           "--payload", str(payload), "--messages", str(200_000 if payload <= 100 else 50_000)]
                    if m == "tls":
                        cmd += ["--tls", ca]
                    before = cpu_seconds(d.pid)
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode != 0:
                        print(f"pubsub-bench failed ({m}, {case}): {out.stderr.strip()}")
                        return 1
                    res = json.loads(out.stdout)
                    used = cpu_seconds(d.pid) - before
                    delivered = res["messages"] * subs
                    got[(case, m)].append((res["msgs_per_s"], used / delivered * 1e6))
                    print(f"round {r + 1} {subs} x {payload} B {m}: {res['msgs_per_s']:.0f} msgs/s, "
                          f"{used / delivered * 1e6:.2f} us dispatcher CPU a delivery", file=sys.stderr)
    finally:
        d.terminate()
        d.wait(timeout=30)
    print("| subscribers x payload | plain msgs/s | TLS msgs/s | TLS / plain | plain dispatcher CPU us a delivery | "
          "TLS | TLS / plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in CASES:
        p = [statistics.median(x[k] for x in got[(case, "plain")]) for k in (0, 1)]
        t = [statistics.median(x[k] for x in got[(case, "tls")]) for k in (0, 1)]
        print(f"| {case[0]} x {case[1]} B | {p[0]:.0f} | {t[0]:.0f} | {t[0] / p[0]:.2f} | {p[1]:.2f} | {t[1]:.2f} | "
              f"{t[1] / p[1]:.2f} |")
    print(f"\n{rounds} rounds, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d', time.gmtime())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
