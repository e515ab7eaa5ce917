"""A real Prometheus (Debian's) with deploy/prometheus's configuration and rules, scraping a
real `shoal run`: it finds every process through run control's service discovery, sees
their metrics (every one the Grafana dashboard and the rules name), and raises
ShoalProcessDown for a builder killed during the run."""

import json
import os
import re
import pathlib
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from conftest import ROOT
from shoal_cluster import Cluster, cluster_toml, free_port

DEPLOY = ROOT / "deploy" / "prometheus"


def api(base: str, path: str, **params):
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_for(what: str, check, timeout: float = 90.0):
    """Polls `check()` until it returns something true (bounded); returns it."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:  # not listening yet
            last = e
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def query(base: str, expr: str):
    return api(base, "/api/v1/query", query=expr)["data"]["result"]


@pytest.fixture
def prometheus_bin():
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it when root)")
    return path


def test_prometheus_scrapes_a_run_and_fires_process_down(shoal_bin, tmp_path, prometheus_bin):
    # The writer archives (to a directory): the archive's metrics, which the alerting rules
    # name, are exposed by a real run too.
    archive = f'archive = ["file://{tmp_path / "archive"}"]'
    text = cluster_toml("test", 5, 3, tmp_path / "state", restarts=0, writer_lines=(archive,))
    c = Cluster(shoal_bin, tmp_path, restarts=0, text=text)
    prom = None
    try:
        runcontrol = c.url.removeprefix("http://")
        conf = (DEPLOY / "prometheus.yml").read_text().replace("127.0.0.1:8080", runcontrol)
        conf = conf.replace("scrape_interval: 5s", "scrape_interval: 1s")
        conf = conf.replace("evaluation_interval: 5s", "evaluation_interval: 1s")
        conf = conf.replace("refresh_interval: 5s", "refresh_interval: 1s")
        (tmp_path / "prometheus.yml").write_text(conf)
        shutil.copy(DEPLOY / "shoal.rules.yml", tmp_path / "shoal.rules.yml")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(tmp_path / "prometheus.log", "w")
        prom = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        wait_for("Prometheus to be ready", lambda: urllib.request.urlopen(base + "/-/ready", timeout=5).status == 200)

        c.wait(lambda s: s["state"] == "IDLE", 60, "every process to announce itself")
        c.run_command("INIT", "STANDBY")
        c.run_command("CONFIGURE", "READY")
        c.run_command("START", "RUNNING")

        # Every process and the dispatcher found through run control and scraped.
        # (A process's metrics address arrives with its first statistics.)
        targets = wait_for(
            "every process in the service discovery",
            lambda: (t := api(c.url, "/api/prometheus/targets")) and len(t) == 10 and t,
        )
        assert {g["labels"]["shoal_role"] for g in targets} == {"source", "builder", "writer", "dispatcher"}, targets
        up = wait_for(
            "every process to be scraped",
            lambda: (r := query(base, 'up{job="shoal-processes"} == 1')) and len(r) == 10 and r,
        )
        assert {x["metric"]["shoal_process"] for x in up} >= {"builder0", "source4", "writer", "dispatcher"}
        produced = wait_for(
            "the sources' counters to grow",
            lambda: (r := query(base, "sum(shoal_node_fragments_produced_total)")) and float(r[0]["value"][1]) > 0 and r,
        )
        assert produced
        clocks = wait_for(
            "the clocks run control measured",
            lambda: len(query(base, "shoal_runcontrol_clock_offset_seconds")) == 9,
        )
        assert clocks

        # Every metric the dashboard and the alerting rules name is one a real run exposes,
        # and every dashboard query runs.
        exposed = set(api(base, "/api/v1/label/__name__/values")["data"])
        dashboard = json.loads((ROOT / "deploy" / "grafana" / "shoal-dashboard.json").read_text())
        queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        assert len(queries) >= 15, queries
        # The rules as Prometheus loaded them.
        groups = api(base, "/api/v1/rules")["data"]["groups"]
        rules = [r["query"] for g in groups for r in g["rules"]]
        assert len(rules) >= 8, rules
        named = set(re.findall(r"\bshoal_[a-z0-9_]+", " ".join(queries + rules)))
        assert named and named <= exposed, sorted(named - exposed)
        for q in queries:
            r = api(base, "/api/v1/query", query=q.replace("$__rate_interval", "30s"))
            assert r["status"] == "success", (q, r)
        delay = wait_for(
            "a fragment delay percentile",
            lambda: (r := query(base, dashboard["panels"][3]["targets"][1]["expr"].replace("$__rate_interval", "30s")))
            and r[0]["value"][1] not in ("NaN", "0")
            and r,
        )
        assert 0 < float(delay[0]["value"][1]) < 60, delay

        victim = c.process(c.status(), "builder1")
        os.kill(victim["pid"], signal.SIGKILL)

        def firing():
            alerts = api(base, "/api/v1/alerts")["data"]["alerts"]
            return [
                a
                for a in alerts
                if a["labels"]["alertname"] == "ShoalProcessDown"
                and a["state"] == "firing"
                and a["labels"].get("shoal_process") == "builder1"
            ]

        fired = wait_for("ShoalProcessDown for builder1", firing)
        assert fired[0]["labels"]["severity"] == "critical", fired
        # The others are still up.
        assert len(query(base, 'up{job="shoal-processes"} == 1')) == 9
        c.run_command("STOP", "READY")
    finally:
        if prom is not None:
            os.killpg(prom.pid, signal.SIGTERM)
            try:
                prom.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(prom.pid, signal.SIGKILL)
                prom.wait()
        c.close()
