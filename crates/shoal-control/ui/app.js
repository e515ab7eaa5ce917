// shoal run-control UI: follows /api/ws (the cluster status, pushed on every change),
// keeps the last 10 minutes of rates client-side and draws them with uPlot.
"use strict";

const COMMANDS = ["INIT", "CONFIGURE", "START", "PAUSE", "CONTINUE", "STOP", "RESET", "OFF"];
const KEEP_POINTS = 600;
const COLORS = ["#1d3557", "#e63946", "#2a9d8f", "#f4a261", "#6a4c93", "#457b9d", "#8ab17d", "#b5838d"];

const $ = (id) => document.getElementById(id);
const fmt = (x, d = 1) => (x === undefined || x === null || Number.isNaN(x) ? "-" : Number(x).toFixed(d));

// ---- buttons -------------------------------------------------------------------------
const buttons = {};
for (const c of COMMANDS) {
  const b = document.createElement("button");
  b.textContent = c;
  b.id = "cmd-" + c;
  b.addEventListener("click", () => send(c));
  $("buttons").appendChild(b);
  buttons[c] = b;
}

// ---- token --------------------------------------------------------------------------
// With [cluster.security] every API call needs a token: kept for this tab only
// (sessionStorage), sent as a bearer header, and to the live view as a subprotocol.
let token = sessionStorage.getItem("shoal-token") || "";
const authHeaders = () => (token ? { Authorization: "Bearer " + token } : {});
// A run's files in the archive at its end (writer.archive; docs/archive.md).
function archiveCell(a) {
  if (!a) return "";
  const parts = [`${a.files_safe} of ${a.files} safe`];
  if (a.files_pending) parts.push(`${a.files_pending} pending`);
  if (a.files_quarantined) parts.push(`<b>${a.files_quarantined} quarantined</b>`);
  if (a.bytes_lost) parts.push(`<b>${fmt(a.bytes_lost / 1e6, 1)} MB lost</b>`);
  return parts.join(", ") + ` (${fmt(a.bytes_written / 1e6, 1)} MB)`;
}

function askForToken(why) {
  $("token-form").hidden = false;
  $("token-error").textContent = why || "";
  $("token").focus();
}
$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem("shoal-token", token);
  $("token-form").hidden = true;
  connect();
});

async function send(command) {
  const r = await fetch("/api/command/" + command, { method: "POST", headers: authHeaders() });
  if (r.status === 401) askForToken("the token was refused");
  if (!r.ok) {
    appendLocalLog(command + ": " + r.status + " " + (await r.text()));
  }
}

// ---- alerts --------------------------------------------------------------------------
// The window is computed from this browser's clock: "starts N s ago, lasts M s".
$("alert-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const from = Date.now() / 1000 - Number($("alert-ago").value);
  const to = from + Number($("alert-length").value);
  const body = `from=${from.toFixed(3)} to=${to.toFixed(3)} name=${$("alert-name").value} origin=shoal-ui`;
  const r = await fetch("/api/alert", { method: "POST", body, headers: authHeaders() });
  if (r.status === 401) askForToken("the token was refused");
  appendLocalLog("ALERT: " + r.status + " " + (await r.text()));
});

let localLog = [];
function appendLocalLog(line) {
  localLog.push(new Date().toISOString().slice(0, 19) + "Z (ui) " + line);
  localLog = localLog.slice(-20);
}

// Which commands make sense in which cluster state (the processes check again).
const ALLOWED = {
  UNKNOWN: [], "NO PROCESS": [],
  IDLE: ["INIT", "OFF"], STANDBY: ["CONFIGURE", "RESET", "OFF"],
  READY: ["CONFIGURE", "START", "RESET", "OFF"], RUNNING: ["PAUSE", "STOP", "OFF"],
  PAUSED: ["CONTINUE", "STOP", "OFF"], MIXED: COMMANDS, OFF: [],
};

// ---- charts --------------------------------------------------------------------------
function makeChart(el, seriesDefs, yLabel) {
  const opts = {
    width: Math.max(520, el.clientWidth || 520),
    height: 220,
    scales: { x: { time: true } },
    axes: [{}, { label: yLabel, size: 60 }],
    series: [{}].concat(seriesDefs.map((s, i) => ({ label: s, stroke: COLORS[i % COLORS.length], width: 2 }))),
  };
  const data = [[]].concat(seriesDefs.map(() => []));
  return { plot: new uPlot(opts, data, el), data, labels: seriesDefs.slice() };
}

const charts = {};
function ensureCharts(builders) {
  if (charts.slices && charts.builders === builders.join(",")) return;
  for (const id of ["chart-slices", "chart-mbps", "chart-delay", "chart-drops"]) $(id).innerHTML = "";
  charts.builders = builders.join(",");
  charts.slices = makeChart($("chart-slices"), ["complete", "incomplete"], "slices/s");
  charts.mbps = makeChart($("chart-mbps"), builders.length ? builders : ["(no builder)"], "MB/s");
  charts.delay = makeChart($("chart-delay"), ["p50", "p99", "max"], "ms");
  charts.drops = makeChart($("chart-drops"), ["dropped at source", "discarded at builder", "incomplete slices"], "per s");
}

function push(chart, t, values) {
  chart.data[0].push(t);
  values.forEach((v, i) => chart.data[i + 1].push(v));
  if (chart.data[0].length > KEEP_POINTS) chart.data.forEach((col) => col.shift());
  chart.plot.setData(chart.data);
}

// ---- rendering -----------------------------------------------------------------------
let lastSample = 0;
window.shoalStatus = null; // for the browser test and for curious users in the console

function render(s) {
  window.shoalStatus = s;
  $("cluster").textContent = s.cluster;
  $("insecure").hidden = s.security !== "insecure";
  $("state").textContent = s.state;
  $("state").className = "state " + s.state.replace(/\s/g, "_");
  $("run").textContent = s.run === null || s.run === undefined ? "-" : s.run;
  $("busy").textContent = s.busy ? "carrying out " + s.busy + "..." : "";
  if (s.dispatcher_metrics) {
    $("dispatcher-metrics").textContent = "dispatcher metrics";
    $("dispatcher-metrics").href = "http://" + s.dispatcher_metrics + "/metrics";
  }
  const allowed = ALLOWED[s.state] || COMMANDS;
  for (const c of COMMANDS) buttons[c].disabled = !!s.busy || !allowed.includes(c);

  const procs = s.processes;
  const builders = procs.filter((p) => p.role === "builder");
  const sum = (list, f) => list.reduce((a, p) => a + (p.active ? f(p) : 0), 0);
  const complete = sum(builders, (p) => p.rates.slices_complete_per_s);
  const incomplete = sum(builders, (p) => p.rates.slices_incomplete_per_s);
  const mbps = sum(builders, (p) => p.rates.mbytes_per_s);
  const produced = sum(procs.filter((p) => p.role === "source"), (p) => p.rates.fragments_produced_per_s);
  const events = sum(builders, (p) => p.rates.events_per_s);
  const totals = [
    ["slices/s", fmt(complete + incomplete)], ["complete %", complete + incomplete > 0 ? fmt((100 * complete) / (complete + incomplete)) : "-"],
    ["MB/s", fmt(mbps)], ["fragments/s produced", fmt(produced, 0)], ["events/s", fmt(events)],
    ["active processes", procs.filter((p) => p.active).length + " / " + procs.length],
  ];
  $("totals").innerHTML = totals.map(([k, v]) => `<div id="total-${k.replace(/[^a-z]/g, "")}">${k}<b>${v}</b></div>`).join("");

  // One chart point per second at most (statistics come once a second).
  const now = Date.now() / 1000;
  if (now - lastSample >= 0.9) {
    lastSample = now;
    ensureCharts(builders.map((b) => b.name));
    push(charts.slices, now, [complete, incomplete]);
    push(charts.mbps, now, builders.map((b) => (b.active ? b.rates.mbytes_per_s : null)));
    const act = builders.filter((b) => b.active && b.stats);
    const worst = (f) => (act.length ? Math.max(...act.map((b) => f(b.stats))) / 1000 : null);
    push(charts.delay, now, [worst((x) => x.delay_p50_us), worst((x) => x.delay_p99_us), worst((x) => x.delay_max_us)]);
    const srcDrops = sum(procs.filter((p) => p.role === "source"), (p) => p.rates.drops_per_s);
    const bldDrops = sum(builders, (p) => p.rates.drops_per_s);
    push(charts.drops, now, [srcDrops, bldDrops, incomplete]);
  }

  $("processes").querySelector("tbody").innerHTML = procs
    .map((p) => {
      const r = p.rates;
      const slices = p.role === "builder" ? r.slices_complete_per_s + r.slices_incomplete_per_s : null;
      // The host clock's offset from run control's (what the process would read), and
      // what its data path runs on after the correction, with the measurement's bound.
      const c = p.clock;
      const clock = c
        ? `<span title="host ${fmt(c.offset_ns / 1000, 1)} us, corrected by ${fmt(c.correction_ns / 1000, 1)} us` +
          (c.drift_ppm != null ? `, drift ${fmt(c.drift_ppm, 2)} \u00b1 ${fmt(c.drift_bound_ppm, 2)} ppm` : "") +
          `">` +
          `${fmt(c.offset_ns / 1000, 0)} &rarr; ${fmt(c.residual_ns / 1000, 0)} &plusmn; ${fmt(c.uncertainty_ns / 1000, 0)}</span>`
        : "-";
      const metrics = p.metrics_addr ? `<a href="http://${p.metrics_addr}/metrics">${p.metrics_addr}</a>` : "-";
      return `<tr class="${p.active ? "" : "inactive"}" data-name="${p.name}">
        <td>${p.name}</td><td>${p.role}</td><td>${p.host}</td><td class="num">${p.pid ?? "-"}</td>
        <td class="pstate">${p.state}</td><td>${p.active ? "yes" : "no: " + (p.inactive_reason || "")}</td>
        <td class="num">${p.role === "source" ? fmt(r.fragments_produced_per_s, 0) : "-"}</td>
        <td class="num">${slices === null ? "-" : fmt(slices)}</td>
        <td class="num">${p.role === "builder" ? fmt(r.mbytes_per_s, 2) : "-"}</td>
        <td class="num">${p.role === "builder" && p.stats ? fmt(p.stats.delay_p99_us / 1000, 2) : "-"}</td>
        <td class="num">${fmt(r.drops_per_s)}</td><td class="num clock">${clock}</td><td>${metrics}</td><td>${p.last_reply || ""}</td></tr>`;
    })
    .join("");

  // Problems the diagnosis rules see now, with the action; then when each began and ended.
  const hhmmss = (ns) => new Date(ns / 1e6).toLocaleTimeString();
  const problems = s.problems || [];
  $("problems-count").textContent = problems.length ? `(${problems.length})` : "none";
  $("problems-count").className = problems.length ? "count warn" : "count";
  $("problems").querySelector("tbody").innerHTML = problems
    .map(
      (e) => `<tr class="problem" data-rule="${e.rule}" data-process="${e.process}"><td>${hhmmss(e.began_ns)}</td>
        <td><b>${e.rule}</b></td><td>${e.process}</td><td>${e.detail}</td><td>${e.action}</td></tr>`,
    )
    .join("");
  $("problem-timeline").querySelector("tbody").innerHTML = (s.problem_timeline || [])
    .slice()
    .reverse()
    .map(
      (e) => `<tr class="${e.ended_ns ? "" : "on"}"><td>${hhmmss(e.began_ns)}</td>
        <td>${e.ended_ns ? hhmmss(e.ended_ns) : "on"}</td>
        <td class="num">${e.ended_ns ? fmt((e.ended_ns - e.began_ns) / 1e9, 1) : "-"}</td>
        <td>${e.rule}</td><td>${e.process}</td><td>${e.detail}</td></tr>`,
    )
    .join("");

  const v = s.clock_verdict;
  const cv = $("clock-verdict");
  cv.textContent = v ? v.reason : "";
  cv.className = v && v.level !== "ok" ? "note warn" : "note";

  $("history").querySelector("tbody").innerHTML = s.history
    .map(
      (h) => `<tr><td>${h.run}</td><td>${h.start_time}</td><td class="num">${fmt(h.seconds)}</td>
        <td class="num">${h.slices_complete}</td><td class="num">${h.slices_incomplete}</td><td class="num">${h.events}</td>
        <td class="num">${h.produced}</td><td class="num">${h.lost}</td>
        <td>${h.balanced ? "balanced" : "NOT balanced"}</td><td>${h.inactive.join(", ")}</td>
        <td>${archiveCell(h.archive)}</td></tr>`,
    )
    .join("");
  $("alerts").querySelector("tbody").innerHTML = (s.alerts || [])
    .map((a) =>
      a.error
        ? `<tr><td>${a.name}</td><td colspan="7">${a.error}</td></tr>`
        : `<tr><td>${a.builder}</td><td>${a.name}</td><td class="num">${a.first_slice}-${a.last_slice}</td>
        <td class="num">${a.slices_saved}</td><td class="num">${a.fragments_saved}</td>
        <td class="num">${fmt(a.bytes_saved / 1e6, 2)}</td>
        <td>${a.partly_evicted ? "up to slice " + a.evicted_through : "nothing"}</td><td>${a.closed_by}</td></tr>`,
    )
    .join("");
  $("log").textContent = s.log.concat(localLog).join("\n");
}

// ---- connection ----------------------------------------------------------------------
let live = null;
async function connect() {
  if (live) return;
  // Asked first over HTTP: a refused token is a 401 there, where the live view would
  // only close.
  const probe = await fetch("/api/status", { headers: authHeaders() }).catch(() => null);
  if (probe && probe.status === 401) {
    askForToken(token ? "the token was refused" : "");
    return;
  }
  const protocols = token ? ["shoal.v1", "bearer." + token] : ["shoal.v1"];
  live = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/api/ws", protocols);
  live.onopen = () => { $("conn").textContent = "live"; $("conn").className = "conn"; };
  live.onmessage = (ev) => render(JSON.parse(ev.data));
  live.onclose = () => {
    live = null;
    $("conn").textContent = "disconnected, retrying";
    $("conn").className = "conn down";
    setTimeout(connect, 1000);
  };
}
connect();
