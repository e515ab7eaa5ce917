//! Run control's HTTP API and web UI.
//!
//! - `GET /api/status`: the cluster status (JSON, [`super::status::ClusterStatus`]).
//! - `POST /api/command/{NAME}`: queue a cluster command (`INIT`, `CONFIGURE`, `START`,
//!   `PAUSE`, `CONTINUE`, `STOP`, `RESET`, `OFF`); 202 when accepted, 409 while another
//!   command is being carried out, 400 for an unknown name.
//! - `POST /api/alert`: send an alert (body: the `ALERT` text, `from=... to=... name=...`,
//!   see `shoal_core::alert`) to every builder through the dispatcher; 202 when sent, 400
//!   with the reason for a malformed one, 502 when the dispatcher cannot be reached. The
//!   builders' answers appear in the status (`alerts`).
//! - `GET /api/runs`: the run history; `GET /api/runs/{N}`: one run record.
//! - `GET /api/ws`: WebSocket pushing the status on every change (at most 4 per second).
//! - `GET /metrics`: Prometheus text for run control itself.
//! - `GET /`: the web UI (static files compiled into the binary; charts by uPlot).
//!
//! Who may call what ([`Guard`], docs/security.md): with `[cluster.security] tokens`, every
//! `/api/*` and `/metrics` request needs `Authorization: Bearer TOKEN` (the live view: the
//! WebSocket subprotocol `bearer.TOKEN` beside `shoal.v1`, since a browser cannot set the
//! header there): a `viewer` may read, an `operator` may also POST. No or an unknown
//! token: 401; a role that may not: 403. A browser's POST or live view from a page of
//! another origin is refused (403) whether tokens are on or not. Commands, alerts and
//! refusals go to the audit log ([`crate::audit`]).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, Extension, Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use shoal_core::cluster::ClusterCommand;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::audit::{Audit, AuditEvent};
use super::security::{Identity, Refusal, Role, WatchedTokens};
use super::status::Shared;

/// The HTTP API's door: tokens (none: security off, loopback only), the origins besides
/// the UI's own allowed to POST, and the audit log.
pub struct Guard {
    /// The token file, watched: a token removed from it is refused at the next request.
    pub tokens: Option<Arc<WatchedTokens>>,
    pub allowed_origins: Vec<String>,
    pub audit: Arc<Audit>,
    /// TLS for the API and UI (`[cluster.security] web_config`).
    pub web: Option<Arc<shoal_tls::web::WebConfig>>,
    /// Run control's credentials for a secured dispatcher (alerts go through it).
    pub control: Option<shoal_dispatcher::client::ControlTls>,
}

/// Who is calling, as the guard found it: the token's holder (none with security off) and
/// the client's address.
#[derive(Clone, Debug)]
struct Caller {
    identity: Option<Identity>,
    address: String,
}

/// The WebSocket subprotocol of the live view; a token rides beside it as `bearer.TOKEN`.
pub const WS_PROTOCOL: &str = "shoal.v1";

/// A browser page may POST and open the live view only from the UI's own origin (or one
/// allowed): `Origin` must name the host the request was sent to. Clients that are no
/// browser send no `Origin` and are judged by their token.
fn origin_allowed(headers: &HeaderMap, allowed: &[String]) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    let own = |scheme: &str| !host.is_empty() && origin == format!("{scheme}://{host}");
    own("http") || own("https") || allowed.iter().any(|a| a == origin)
}

/// The token a request presents: `Authorization: Bearer`, or for the live view the
/// subprotocol `bearer.TOKEN`, as an `Authorization` value.
fn presented(headers: &HeaderMap, websocket: bool) -> Option<String> {
    if let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        return Some(v.to_string());
    }
    if !websocket {
        return None;
    }
    let protocols = headers.get(header::SEC_WEBSOCKET_PROTOCOL).and_then(|v| v.to_str().ok())?;
    protocols.split(',').map(str::trim).find_map(|p| p.strip_prefix("bearer.")).map(|t| format!("Bearer {t}"))
}

async fn check_caller(
    State(s): State<AppState>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    if !(path.starts_with("/api/") || path == "/metrics") {
        return next.run(req).await;
    }
    let writes = !matches!(*req.method(), Method::GET | Method::HEAD);
    let websocket = path == "/api/ws";
    let address = peer.to_string();
    let refused = |r: Refusal, identity: Option<&Identity>| {
        let kind = if path.starts_with("/api/command/") {
            "command"
        } else if path == "/api/alert" {
            "alert"
        } else {
            "request"
        };
        s.guard.audit.record(AuditEvent {
            time: String::new(),
            kind: kind.into(),
            what: format!("{} {path}", req.method()),
            outcome: "refused".into(),
            reason: r.reason().into(),
            identity: identity.map(|i| i.name.clone()).unwrap_or_default(),
            role: identity.map(|i| i.role.to_string()).unwrap_or_default(),
            address: address.clone(),
            ..Default::default()
        });
        refusal_response(r)
    };
    if (writes || websocket) && !origin_allowed(req.headers(), &s.guard.allowed_origins) {
        return refused(Refusal::Origin, None);
    }
    let identity = match &s.guard.tokens {
        None => None,
        Some(watched) => {
            let tokens = watched.current();
            let need = if writes { Role::Operator } else { Role::Viewer };
            let presented = presented(req.headers(), websocket);
            match tokens.authorize(presented.as_deref(), need) {
                Ok(who) => Some(who),
                Err(r) => {
                    // A known token with too small a role: the audit names its holder.
                    let holder = match r {
                        Refusal::Role { .. } => presented
                            .as_deref()
                            .and_then(|p| p.strip_prefix("Bearer "))
                            .and_then(|t| tokens.identify(t.trim())),
                        _ => None,
                    };
                    return refused(r, holder.as_ref());
                }
            }
        }
    };
    req.extensions_mut().insert(Caller { identity, address });
    next.run(req).await
}

fn refusal_response(r: Refusal) -> Response {
    match r {
        Refusal::NoToken | Refusal::BadToken => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer realm=\"shoal run control\"")],
            if r == Refusal::NoToken { "a token is needed (Authorization: Bearer TOKEN)" } else { "unknown token" },
        )
            .into_response(),
        Refusal::Role { have, need } => {
            (StatusCode::FORBIDDEN, format!("a {have} token may not do this; it needs {need}")).into_response()
        }
        Refusal::Expired | Refusal::Revoked => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer realm=\"shoal run control\", error=\"invalid_token\"")],
            if r == Refusal::Expired { "this token has expired" } else { "this token has been revoked" },
        )
            .into_response(),
        Refusal::Origin => (StatusCode::FORBIDDEN, "a page of another origin may not do this").into_response(),
    }
}

/// Audits what a caller asked and how it ended.
fn audit_outcome(s: &AppState, caller: &Caller, kind: &str, what: String, status: StatusCode, reason: &str) {
    let outcome = if status.is_success() { "accepted" } else { "failed" };
    s.guard.audit.record(AuditEvent {
        time: String::new(),
        kind: kind.into(),
        what,
        outcome: outcome.into(),
        reason: if status.is_success() { String::new() } else { reason.into() },
        identity: caller.identity.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
        role: caller.identity.as_ref().map(|i| i.role.to_string()).unwrap_or_default(),
        address: caller.address.clone(),
        ..Default::default()
    });
}

#[derive(Clone)]
struct AppState {
    shared: Arc<Shared>,
    commands: mpsc::Sender<ClusterCommand>,
    state_dir: std::path::PathBuf,
    dispatcher: std::net::SocketAddr,
    /// Places for live views (WebSockets): an upgraded connection is no longer the HTTP
    /// server's to limit.
    websockets: Arc<tokio::sync::Semaphore>,
    guard: Arc<Guard>,
}

/// Most live views at once (each a task and a descriptor).
const MAX_WEBSOCKETS: usize = 64;
/// A live view that does not take a status push within this long is closed (a client
/// that never reads holds its place for nothing).
const WEBSOCKET_SEND_TIMEOUT: Duration = Duration::from_secs(10);

const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const STYLE_CSS: &str = include_str!("../ui/style.css");
const UPLOT_JS: &str = include_str!("../ui/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../ui/vendor/uPlot.min.css");

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

async fn status(State(s): State<AppState>) -> impl IntoResponse {
    Json(s.shared.snapshot())
}

async fn command(
    State(s): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Response {
    let (status, answer) = queue_command(&s, &name);
    audit_outcome(&s, &caller, "command", name, status, &answer);
    (status, answer).into_response()
}

fn queue_command(s: &AppState, name: &str) -> (StatusCode, String) {
    let command = match name.parse::<ClusterCommand>() {
        Ok(c) => c,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()),
    };
    if let Some(busy) = s.shared.snapshot().busy {
        return (StatusCode::CONFLICT, format!("busy with {busy}"));
    }
    match s.commands.try_send(command) {
        Ok(()) => (StatusCode::ACCEPTED, format!("{command} queued")),
        Err(_) => (StatusCode::CONFLICT, "a command is already queued".to_string()),
    }
}

async fn alert(State(s): State<AppState>, Extension(caller): Extension<Caller>, body: axum::body::Bytes) -> Response {
    let (status, answer) = match shoal_core::alert::Alert::parse(&body) {
        Err(e) => (StatusCode::BAD_REQUEST, format!("alert refused: {e}")),
        Ok(alert) => match send_alert(s.dispatcher, s.guard.control.clone(), &alert).await {
            Ok(()) => {
                s.shared.update(|st| st.note(format!("alert sent: {alert}")));
                (StatusCode::ACCEPTED, format!("alert {} sent", alert.name))
            }
            Err(e) => (StatusCode::BAD_GATEWAY, format!("cannot reach the dispatcher: {e}")),
        },
    };
    audit_outcome(&s, &caller, "alert", String::from_utf8_lossy(&body).into_owned(), status, &answer);
    (status, answer).into_response()
}

/// Publishes one alert on the dispatcher (a connection of its own, closed after).
pub async fn send_alert(
    dispatcher: std::net::SocketAddr,
    control: Option<shoal_dispatcher::client::ControlTls>,
    alert: &shoal_core::alert::Alert,
) -> anyhow::Result<()> {
    let mut client = shoal_dispatcher::client::ChClient::connect_with(dispatcher, control).await?;
    client.publish(shoal_core::alert::ALERT_TAG, alert.encode().as_bytes()).await?;
    Ok(())
}

/// Prometheus HTTP service discovery (`http_sd_configs`, deploy/prometheus): every process's
/// `/metrics` as it announced it, and the dispatcher's, labelled with process and role.
async fn prometheus_targets(State(s): State<AppState>) -> impl IntoResponse {
    Json(prometheus_target_groups(&s.shared.snapshot()))
}

/// The target groups of `prometheus_targets`. A process bound to every address
/// (`0.0.0.0:PORT`) is reached at its host's name from the cluster file.
pub fn prometheus_target_groups(st: &crate::status::ClusterStatus) -> Vec<serde_json::Value> {
    let reachable = |addr: &str, host: &str| match addr.strip_prefix("0.0.0.0:").or_else(|| addr.strip_prefix("[::]:"))
    {
        Some(port) => format!("{host}:{port}"),
        None => addr.to_string(),
    };
    let mut groups: Vec<serde_json::Value> = st
        .processes
        .iter()
        .filter_map(|p| {
            let addr = p.metrics_addr.as_deref()?;
            Some(serde_json::json!({
                "targets": [reachable(addr, &p.host)],
                "labels": { "shoal_cluster": st.cluster, "shoal_process": p.name, "shoal_role": p.role },
            }))
        })
        .collect();
    if let Some(addr) = &st.dispatcher_metrics {
        groups.push(serde_json::json!({
            "targets": [reachable(addr, "localhost")],
            "labels": { "shoal_cluster": st.cluster, "shoal_process": "dispatcher", "shoal_role": "dispatcher" },
        }));
    }
    groups
}

async fn runs(State(s): State<AppState>) -> impl IntoResponse {
    Json(s.shared.snapshot().history)
}

async fn run_record(State(s): State<AppState>, Path(n): Path<u64>) -> Response {
    let path = s.state_dir.join("runs").join(format!("run{n:06}.json"));
    match std::fs::read(&path) {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(_) => (StatusCode::NOT_FOUND, format!("no record of run {n}")).into_response(),
    }
}

async fn ws(State(s): State<AppState>, upgrade: WebSocketUpgrade) -> Response {
    // The token, if any, came as a second subprotocol: the one selected is ours.
    let upgrade = upgrade.protocols([WS_PROTOCOL]);
    let Ok(place) = s.websockets.clone().try_acquire_owned() else {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("at most {MAX_WEBSOCKETS} live views at once"))
            .into_response();
    };
    upgrade.on_upgrade(move |socket| async move {
        push_status(socket, s.shared).await;
        drop(place);
    })
}

async fn push_status(mut socket: WebSocket, shared: Arc<Shared>) {
    let mut changed = shared.subscribe();
    loop {
        let text = match serde_json::to_string(&shared.snapshot()) {
            Ok(t) => t,
            Err(_) => return,
        };
        match tokio::time::timeout(WEBSOCKET_SEND_TIMEOUT, socket.send(Message::Text(text.into()))).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        // At most four pushes a second, at least one every two seconds.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), changed.changed()).await;
    }
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    let st = s.shared.snapshot();
    let mut reg = Registry::default();
    let procs = Family::<Vec<(String, String)>, Gauge>::default();
    for p in &st.processes {
        procs
            .get_or_create(&vec![
                ("name".into(), p.name.clone()),
                ("role".into(), p.role.clone()),
                ("state".into(), p.state.clone()),
            ])
            .set(i64::from(p.active));
    }
    reg.register("shoal_runcontrol_process_active", "1 if the process is active, by its last state", procs);
    let run = Gauge::<i64>::default();
    run.set(st.run.map_or(0, |r| r as i64));
    reg.register("shoal_runcontrol_run", "The run in progress (0: none)", run);
    // Clocks (docs/clocks.md): seconds, as Prometheus wants them.
    type Seconds = Gauge<f64, std::sync::atomic::AtomicU64>;
    type Field = fn(&crate::clocks::ProcessClock) -> f64;
    let families: [(&str, &str, Field); 4] = [
        ("shoal_runcontrol_clock_offset_seconds", "The process's host clock minus run control's, uncorrected", |c| {
            c.offset_ns as f64 * 1e-9
        }),
        (
            "shoal_runcontrol_clock_residual_seconds",
            "The process's corrected clock (what its data path runs on) minus run control's",
            |c| c.residual_ns as f64 * 1e-9,
        ),
        (
            "shoal_runcontrol_clock_uncertainty_seconds",
            "The measured offset is within this of the true one (half the least round trip)",
            |c| c.uncertainty_ns as f64 * 1e-9,
        ),
        (
            "shoal_runcontrol_clock_correction_seconds",
            "The correction run control gave the process (subtracted from its host clock)",
            |c| c.correction_ns as f64 * 1e-9,
        ),
    ];
    for (name, help, value) in families {
        let fam = Family::<Vec<(String, String)>, Seconds>::default();
        for p in &st.processes {
            if let Some(c) = &p.clock {
                fam.get_or_create(&vec![("name".into(), p.name.clone()), ("role".into(), p.role.clone())])
                    .set(value(c));
            }
        }
        reg.register(name, help, fam);
    }
    let drift = Family::<Vec<(String, String)>, Seconds>::default();
    for p in &st.processes {
        if let Some(d) = p.clock.as_ref().and_then(|c| c.drift_ppm) {
            drift.get_or_create(&vec![("name".into(), p.name.clone()), ("role".into(), p.role.clone())]).set(d * 1e-6);
        }
    }
    reg.register(
        "shoal_runcontrol_clock_drift_ratio",
        "How fast the process's host clock runs against run control's (1e-6: 1 ppm fast), since it was first measured",
        drift,
    );
    if let Some(v) = &st.clock_verdict {
        let skew = Seconds::default();
        skew.set(v.skew_ns as f64 * 1e-9);
        reg.register(
            "shoal_runcontrol_clock_skew_seconds",
            "Worst skew between two data processes' corrected clocks, uncertainties included",
            skew,
        );
        let tolerated = Seconds::default();
        tolerated.set(v.tolerated_ns as f64 * 1e-9);
        reg.register("shoal_runcontrol_clock_tolerated_seconds", "The skew the run's policy absorbs", tolerated);
    }
    // The diagnosis rules' problems now: one series per rule and process, 1 while on
    // (every rule present, so an alert on `> 0` has a series to look at).
    let problems = Family::<Vec<(String, String)>, Gauge>::default();
    for rule in shoal_core::diagnosis::Rule::ALL {
        problems.get_or_create(&vec![("rule".into(), rule.name().into()), ("process".into(), String::new())]).set(0);
    }
    for e in &st.problems {
        problems
            .get_or_create(&vec![("rule".into(), e.rule.name().into()), ("process".into(), e.process.clone())])
            .set(1);
    }
    reg.register(
        "shoal_runcontrol_problem",
        "1 while the diagnosis rule finds its problem on the process (docs/monitoring.md); each rule has a series with no process at 0",
        problems,
    );
    let (counts, failed_writes) = s.guard.audit.counts();
    let audited = Family::<Vec<(String, String)>, Gauge>::default();
    for ((kind, outcome), n) in counts {
        audited.get_or_create(&vec![("kind".into(), kind), ("outcome".into(), outcome)]).set(n as i64);
    }
    reg.register(
        "shoal_runcontrol_audit_events",
        "Commands, alerts and refused requests of the HTTP API since run control started, by outcome (docs/security.md)",
        audited,
    );
    let unwritten = Gauge::<i64>::default();
    unwritten.set(failed_writes as i64);
    reg.register("shoal_runcontrol_audit_unwritten", "Audit events that could not be written to the log", unwritten);
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String");
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], out)
}

/// Serves the API and the UI until `cancel`.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    commands: mpsc::Sender<ClusterCommand>,
    state_dir: std::path::PathBuf,
    dispatcher: std::net::SocketAddr,
    guard: Guard,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let web = guard.web.clone();
    let state = AppState {
        shared,
        commands,
        state_dir,
        dispatcher,
        websockets: Arc::new(tokio::sync::Semaphore::new(MAX_WEBSOCKETS)),
        guard: Arc::new(guard),
    };
    let app = Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
        .route("/ui/app.js", get(|| async { asset("text/javascript", APP_JS) }))
        .route("/ui/style.css", get(|| async { asset("text/css", STYLE_CSS) }))
        .route("/ui/vendor/uPlot.iife.min.js", get(|| async { asset("text/javascript", UPLOT_JS) }))
        .route("/ui/vendor/uPlot.min.css", get(|| async { asset("text/css", UPLOT_CSS) }))
        .route("/api/status", get(status))
        .route("/api/command/{name}", post(command))
        .route("/api/alert", post(alert).layer(axum::extract::DefaultBodyLimit::max(shoal_core::alert::MAX_ALERT_LEN)))
        .route("/api/runs", get(runs))
        .route("/api/runs/{n}", get(run_record))
        .route("/api/ws", get(ws))
        .route("/metrics", get(metrics))
        .route("/api/prometheus/targets", get(prometheus_targets))
        .layer(axum::middleware::from_fn_with_state(state.clone(), check_caller))
        .with_state(state);
    let limits = shoal_dispatcher::httpd::HttpLimits::default();
    let stats = Arc::new(shoal_dispatcher::httpd::HttpStats::default());
    shoal_dispatcher::httpd::serve_with(listener, app, limits, stats, "run control", web, cancel).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{ClusterStatus, ProcStatus};

    #[test]
    fn service_discovery_lists_every_announced_process_at_a_reachable_address() {
        let proc = |name: &str, role: &str, host: &str, addr: Option<&str>| ProcStatus {
            name: name.into(),
            role: role.into(),
            host: host.into(),
            metrics_addr: addr.map(String::from),
            ..Default::default()
        };
        let st = ClusterStatus {
            cluster: "sector".into(),
            processes: vec![
                proc("builder0", "builder", "daq-07", Some("0.0.0.0:9101")),
                proc("source0", "source", "localhost", Some("127.0.0.1:40001")),
                proc("writer", "writer", "localhost", None), // not announced yet
            ],
            dispatcher_metrics: Some("127.0.0.1:5554".into()),
            ..Default::default()
        };
        let groups = prometheus_target_groups(&st);
        assert_eq!(groups.len(), 3, "{groups:?}");
        assert_eq!(groups[0]["targets"][0], "daq-07:9101", "bound to every address: reached at its host");
        assert_eq!(groups[0]["labels"]["shoal_role"], "builder");
        assert_eq!(groups[1]["targets"][0], "127.0.0.1:40001");
        assert_eq!(groups[2]["labels"]["shoal_process"], "dispatcher");
        assert_eq!(groups[2]["labels"]["shoal_cluster"], "sector");
    }
}
