"""Filter plug-ins in a run (docs/plugins.md): `shoal demo` with the C `l1` of
examples/c/filter/ (built by `make c-examples`) as the builders' filter. That it selects the
built-in `l1`'s very events on the same slices is crates/shoal-trigger/tests/plugin.rs;
here it runs in the builders of a real run, and a plug-in that cannot load stops the run
before it starts, saying why."""
import json
import os
import pathlib
import subprocess

import pyarrow.parquet as pq

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


def test_the_c_l1_plugin_isolated_in_worker_processes_filters_a_run(shoal_bin, tmp_path):
    lib = C_EXAMPLES / "libl1_filter.so"
    r = demo(shoal_bin, tmp_path, f'[builder.filter]\nplugin = "{lib}"\nisolate = true\nworkers = 2\n'
             'config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"\n')
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ledger"]["balanced"] and s["events"] > 0
    for b in s["builder_reports"]:
        w = b["filter_workers"]
        assert w["workers"] == 2 and w["slices"] > 0
        assert (w["failed"], w["crashed"], w["timed_out"], w["restarts"]) == (0, 0, 0, 0), w
        assert (b["filter_failed"], b["filter_timeout"], b["filter_malformed_events"]) == (0, 0, 0), b


# Segfaults once, hangs once (across worker processes: marker files), fails every fifth
# slice, and hands back one event per slice otherwise.
FAULTY_C = r"""
#include <shoal_filter.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char marks[512];

static int once(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", marks, name);
    int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0600);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

uint32_t shoal_filter_abi_version(void) { return SHOAL_FILTER_ABI_VERSION; }

int32_t shoal_filter_init(const char *config, void **out, char *error, size_t error_len) {
    (void)error; (void)error_len;
    snprintf(marks, sizeof marks, "%s", config);
    *out = NULL;
    return 0;
}

int32_t shoal_filter_process(void *state, const shoal_slice_view *s, const shoal_filter_host *host) {
    (void)state;
    if (s->slice % 5 == 0) return 1;
    if (s->slice % 7 == 3 && once("segv")) {
        volatile int *nowhere = NULL;
        *nowhere = 1; /* a real segmentation fault */
    }
    if (s->slice % 7 == 4 && once("hang")) sleep(3600);
    shoal_event_hit h = {0};
    h.source = s->fragments[0].source;
    return host->emit_event(host->ctx, 1, 0, &h, 1);
}

void shoal_filter_cleanup(void *state) { (void)state; }
"""


def test_an_isolated_plugin_that_fails_crashes_and_hangs_costs_only_its_slices(shoal_bin, tmp_path):
    src = tmp_path / "faulty.c"
    src.write_text(FAULTY_C)
    lib = tmp_path / "libfaulty.so"
    include = pathlib.Path(__file__).resolve().parents[2] / "include"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-I", str(include), "-o", str(lib), str(src)], check=True)
    marks = tmp_path / "marks"
    marks.mkdir()
    r = demo(shoal_bin, tmp_path, f'[builder.filter]\nplugin = "{lib}"\nisolate = true\nworkers = 2\ntimeout_ms = 3000\n'
             f'config = "{marks}"\n')
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(marks)) == ["hang", "segv"], "both faults happened"
    s = json.loads(r.stdout)
    assert s["ledger"]["balanced"] and s["ledger"]["unaccounted"] == 0
    reports = s["builder_reports"]
    workers = [b["filter_workers"] for b in reports]
    failed = sum(b["filter_failed"] for b in reports)
    assert sum(b["filter_timeout"] for b in reports) == 1
    assert sum(w["crashed"] for w in workers) == 1 and sum(w["restarts"] for w in workers) == 2
    assert failed == sum(w["failed"] for w in workers) + 1 and failed > 1
    processed = sum(w["slices"] for w in workers)
    assert s["events"] == processed - failed - 1
    kept = pq.read_table(next((tmp_path / "out").glob("run*.slices.parquet")), columns=["slice"]).column("slice").to_pylist()
    assert len(set(kept)) == failed + 1
