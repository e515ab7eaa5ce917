"""One saturated `shoal demo` run for the benchmarks (scripts/throughput.py,
tbf_accuracy.py, packet_spacing.py): fixed fragments, no filter, no burst saver, sources
producing as fast as the transport takes (or, with `saturate=False`, one fragment per
slice). Free-running sources are not held together by a clock, so the builders' assembly
window is opened: the drift between them costs memory (peak RSS), not data."""
import json
import os
import subprocess
import sys
import tempfile


def config(sources, builders, fragment, slices, policy, saturate=True, builder_budget_mb=1024):
    return f"""[run]
sources = {sources}
builders = {builders}
slice_ms = 1
seconds = {slices / 1000}
policy = "{policy}"
[source]
generator = "fixed"
fixed_bytes = {fragment}
saturate = {"true" if saturate else "false"}
[builder]
max_active = 1000000
wall_timeout_ms = 60000
memory_budget_mb = {builder_budget_mb}
[builder.filter]
name = "none"
[saver]
enabled = false
"""


def run(shoal, cfg_text, prefix=(), timeout=600):
    """The demo's JSON summary; `prefix` runs it inside something (`ip netns exec NS`)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cfg.toml")
        with open(path, "w") as f:
            f.write(cfg_text)
        # UCX writes its own messages on stdout unless told otherwise: keep the JSON alone.
        env = {**os.environ, "UCX_LOG_FILE": os.environ.get("UCX_LOG_FILE", "stderr")}
        out = subprocess.run([*prefix, shoal, "demo", "--config", path, "--out", os.path.join(d, "out"), "--json"],
                             capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"shoal demo failed ({out.returncode}): {out.stderr[-2000:]}")
    # The summary is the first JSON value; anything after it (a library's warnings at the
    # process's exit, UCX's among them) is shown, not parsed.
    summary, end = json.JSONDecoder().raw_decode(out.stdout.lstrip())
    rest = out.stdout.lstrip()[end:].strip()
    if rest:
        print(f"after the demo's summary: {rest[:2000]}", file=sys.stderr)
    return summary


def accounted(r):
    """Every fragment in a bucket and every slice complete."""
    ledger = r["ledger"]
    return ledger["balanced"] and ledger["unaccounted"] == 0 and r["slices_incomplete"] == 0
