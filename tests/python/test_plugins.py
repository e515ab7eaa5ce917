"""Filter plug-ins in a run (docs/plugins.md): `shoal demo` with the C `l1` of
examples/c/filter/ (built by `make c-examples`) as the builders' filter. That it selects the
built-in `l1`'s very events on the same slices is crates/shoal-trigger/tests/plugin.rs;
here it runs in the builders of a real run, and a plug-in that cannot load stops the run
before it starts, saying why."""
import json
import os
import pathlib
import subprocess

C_EXAMPLES = pathlib.Path(os.environ.get("SHOAL_C_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "target" / "c"))


def demo(shoal_bin, tmp_path, filter_toml: str):
    cfg = tmp_path / "shoal.toml"
    cfg.write_text("[run]\nsources = 5\nbuilders = 2\nseconds = 2.0\n[source.physics]\nmuon_rate_hz = 200.0\n" + filter_toml)
    return subprocess.run(
        [str(shoal_bin), "demo", "--config", str(cfg), "--out", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, timeout=180,
    )


def test_the_c_l1_plugin_filters_a_run(shoal_bin, tmp_path):
    lib = C_EXAMPLES / "libl1_filter.so"
    assert lib.exists(), "make c-examples builds it"
    r = demo(shoal_bin, tmp_path, f'[builder.filter]\nplugin = "{lib}"\n'
             'config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"\n')
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ledger"]["balanced"] and s["slices_incomplete"] == 0
    assert s["events"] > 0 and s["writer"]["file"]["events"] == s["events"]
    for b in s["builder_reports"]:
        assert (b["filter_failed"], b["filter_malformed_events"]) == (0, 0), b


def test_a_plugin_that_cannot_load_stops_the_run_with_its_reason(shoal_bin, tmp_path):
    r = demo(shoal_bin, tmp_path, '[builder.filter]\nplugin = "/nonexistent/libfilter.so"\n')
    assert r.returncode != 0
    assert "/nonexistent/libfilter.so" in r.stderr, r.stderr
