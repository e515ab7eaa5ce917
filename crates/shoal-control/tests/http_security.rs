//! Run control's HTTP API as a stranger, a viewer and an operator would call it
//! (docs/security.md, the attack matrix's HTTP rows): no, bad token: 401; a viewer
//! commanding: 403; a page of another origin POSTing: 403; the live view without a token:
//! 401, with its subprotocol token: upgraded; a token removed from the file while the API
//! runs: 401, audited as revoked. Every refusal and command in the audit log.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use shoal_control::audit::{Audit, read};
use shoal_control::http::{Guard, serve};
use shoal_control::security::{Role, TokenFile, WatchedTokens};
use shoal_control::status::{ClusterStatus, Shared};
use tokio_util::sync::CancellationToken;

struct Api {
    addr: std::net::SocketAddr,
    commands: tokio::sync::mpsc::Receiver<shoal_core::cluster::ClusterCommand>,
    cancel: CancellationToken,
    audit: Arc<Audit>,
    dir: std::path::PathBuf,
}

/// Run control's API on a free loopback port, with a token file of one viewer and one
/// operator (their tokens returned), or with security off.
async fn start(secured: bool) -> (Api, String, String) {
    let dir = std::env::temp_dir().join(format!("shoal-http-security-{}-{secured}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens.toml");
    let viewer = TokenFile::add(&file, "alice", Role::Viewer).unwrap();
    let operator = TokenFile::add(&file, "bob", Role::Operator).unwrap();
    let tokens = secured.then(|| Arc::new(WatchedTokens::load(&file).unwrap()));
    let audit = Arc::new(Audit::new(&dir));
    let guard = Guard {
        tokens,
        allowed_origins: vec!["https://ops.example".into()],
        audit: audit.clone(),
        web: None,
        control: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, commands) = tokio::sync::mpsc::channel(8);
    let cancel = CancellationToken::new();
    let shared = Shared::new(ClusterStatus { cluster: "t".into(), ..Default::default() });
    // Not a real dispatcher: the alert rows are not asked here.
    let dispatcher = "127.0.0.1:9".parse().unwrap();
    tokio::spawn(serve(listener, shared, tx, dir.clone(), dispatcher, guard, cancel.clone()));
    (Api { addr, commands, cancel, audit, dir }, viewer, operator)
}

/// One HTTP/1.1 request; the status code and the whole response.
async fn request(addr: std::net::SocketAddr, head: String) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(head.as_bytes()).unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // An upgraded connection stays open: read until the head and what came with it.
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
            if head.contains("Upgrade: websocket") && out.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, text)
    })
    .await
    .unwrap()
}

fn get(path: &str, token: Option<&str>) -> String {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n")
}

fn post(path: &str, token: Option<&str>, origin: Option<&str>) -> String {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let origin = origin.map(|o| format!("Origin: {o}\r\n")).unwrap_or_default();
    format!("POST {path} HTTP/1.1\r\nHost: localhost\r\n{auth}{origin}Content-Length: 0\r\nConnection: close\r\n\r\n")
}

fn websocket(protocols: &str) -> String {
    format!(
        "GET /api/ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: {protocols}\r\n\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_roles_decide_who_reads_and_who_commands() {
    let (mut api, viewer, operator) = start(true).await;
    let a = api.addr;
    assert_eq!(request(a, get("/api/status", None)).await.0, 401, "no token");
    assert_eq!(request(a, get("/api/status", Some("shoal_0000"))).await.0, 401, "a bad token");
    assert_eq!(request(a, get("/metrics", None)).await.0, 401, "metrics need a token too");
    let (code, body) = request(a, get("/api/status", Some(&viewer))).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"cluster\":\"t\""), "{body}");
    let (code, body) = request(a, post("/api/command/INIT", Some(&viewer), None)).await;
    assert_eq!(code, 403, "a viewer may not command: {body}");
    assert!(api.commands.try_recv().is_err(), "nothing queued by the viewer");
    let (code, body) = request(a, post("/api/command/INIT", Some(&operator), None)).await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(api.commands.recv().await, Some(shoal_core::cluster::ClusterCommand::Init));
    // A page of another origin, even with a token it stole: refused.
    let evil = Some("http://evil.example");
    assert_eq!(request(a, post("/api/command/OFF", Some(&operator), evil)).await.0, 403);
    let (code, body) = request(a, post("/api/command/OFF", Some(&operator), Some("http://localhost"))).await;
    assert!(code == 202 && body.contains("OFF queued"), "the UI's own origin: {body}");
    assert_eq!(api.commands.recv().await, Some(shoal_core::cluster::ClusterCommand::Off));
    // The live view: its token as a subprotocol.
    assert_eq!(request(a, websocket("shoal.v1")).await.0, 401, "the live view without a token");
    let (code, head) = request(a, websocket(&format!("shoal.v1, bearer.{viewer}"))).await;
    assert_eq!(code, 101, "{head}");
    assert!(head.to_ascii_lowercase().contains("sec-websocket-protocol: shoal.v1"), "{head}");

    let (counts, _) = api.audit.counts();
    assert_eq!(counts[&("command".to_string(), "accepted".to_string())], 2);
    assert_eq!(counts[&("command".to_string(), "refused".to_string())], 2, "the viewer's and the foreign page's");
    assert_eq!(counts[&("request".to_string(), "refused".to_string())], 4);
    let (events, _) = read(api.audit.path()).unwrap();
    let viewer_refused = events.iter().find(|e| e.kind == "command" && e.reason == "role").unwrap();
    assert_eq!((viewer_refused.identity.as_str(), viewer_refused.role.as_str()), ("alice", "viewer"));
    assert!(viewer_refused.address.starts_with("127.0.0.1:"));
    let accepted = events.iter().find(|e| e.outcome == "accepted").unwrap();
    assert_eq!((accepted.identity.as_str(), accepted.what.as_str()), ("bob", "INIT"));
    assert!(!events.iter().any(|e| e.what.contains(&viewer) || e.what.contains(&operator)), "no token in the log");
    // `shoal token remove`: the running API refuses the operator's token at its next
    // request, audited as revoked; the viewer's goes on.
    TokenFile::remove(&api.dir.join("tokens.toml"), "bob").unwrap();
    let (code, body) = request(a, post("/api/command/INIT", Some(&operator), None)).await;
    assert_eq!(code, 401, "a removed token: {body}");
    assert!(body.contains("revoked"), "{body}");
    assert!(api.commands.try_recv().is_err(), "nothing queued by the revoked token");
    assert_eq!(request(a, get("/api/status", Some(&viewer))).await.0, 200);
    let (events, _) = read(api.audit.path()).unwrap();
    assert_eq!(events.iter().filter(|e| e.reason == "revoked").count(), 1, "{events:?}");
    api.cancel.cancel();
    std::fs::remove_dir_all(&api.dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_security_the_api_is_open_on_loopback_but_not_to_other_origins() {
    let (mut api, _, _) = start(false).await;
    let a = api.addr;
    assert_eq!(request(a, get("/api/status", None)).await.0, 200);
    assert_eq!(request(a, post("/api/command/INIT", None, None)).await.0, 202);
    assert_eq!(api.commands.recv().await, Some(shoal_core::cluster::ClusterCommand::Init));
    assert_eq!(request(a, post("/api/command/OFF", None, Some("http://evil.example"))).await.0, 403);
    assert_eq!(request(a, post("/api/command/OFF", None, Some("https://ops.example"))).await.0, 202, "allowed");
    assert_eq!(request(a, websocket("shoal.v1")).await.0, 101);
    let (events, _) = read(api.audit.path()).unwrap();
    assert_eq!(events.iter().filter(|e| e.outcome == "accepted").count(), 2);
    assert_eq!(events.iter().filter(|e| e.reason == "origin").count(), 1);
    api.cancel.cancel();
    std::fs::remove_dir_all(&api.dir).unwrap();
}
