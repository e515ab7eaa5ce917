//! A secured dispatcher (`--credentials`): mutual TLS and plain ControlHost on one port,
//! shoal's tags by author. Certified clients publish what their role and name allow and
//! are refused the rest; a plain client keeps its data tags and is refused shoal's; a
//! stranger's certificate (another CA) gets no connection; a process's control connection
//! that closes is announced on `RC_GONE`, which nobody else can publish.

mod common;

use std::time::Duration;

use common::wait_until;

use shoal_core::controlhost::Mode;
use shoal_dispatcher::authority::{Authority, RC_GONE};
use shoal_dispatcher::client::{ChClient, ControlTls};
use shoal_dispatcher::server::{DispatcherConfig, SecureControl, Snapshot, spawn_dispatcher};
use shoal_tls::Identity;
use shoal_tls::ca::{ClusterCa, IssueRequest};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

fn identity(ca: &ClusterCa, trusted: &ClusterCa, name: &str, role: &str) -> Identity {
    let req = IssueRequest::new(name, role, &["127.0.0.1".into()], 1).unwrap();
    let issued = ca.issue(&req).unwrap();
    Identity::from_pem(trusted.cert_pem().as_bytes(), issued.cert_pem.as_bytes(), issued.key_pem.as_bytes()).unwrap()
}

fn refused(s: &Snapshot, identity: &str, reason: &str, tag: &str) -> u64 {
    s.refused.iter().filter(|r| r.identity == identity && r.reason == reason && r.tag == tag).map(|r| r.count).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_publishes_only_what_its_certificate_allows() {
    let ca = ClusterCa::generate("t", 1).unwrap();
    let dispatcher = identity(&ca, &ca, "dispatcher", "dispatcher");
    let tls = |name: &str, role: &str| Some(ControlTls::new(&identity(&ca, &ca, name, role)).unwrap());
    let secure = SecureControl::new(&dispatcher, Authority::default(), None).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cancel = CancellationToken::new();
    let (h, _core) =
        spawn_dispatcher(l, DispatcherConfig { secure: Some(secure), ..Default::default() }, cancel.clone()).unwrap();

    // Run control listens as run control does.
    let mut rc = ChClient::connect_with(h.addr, tls("runcontrol", "runcontrol")).await.unwrap();
    for t in ["RC_REPLY", "RC_END", RC_GONE, "Died", "DATA"] {
        rc.subscribe(t, Mode::All).await.unwrap();
    }
    // A builder's control connection, named as its certificate.
    let mut b0 = ChClient::connect_with(h.addr, tls("builder0", "builder")).await.unwrap();
    b0.set_nickname("builder0").await.unwrap();
    b0.subscribe("RC_CMD", Mode::All).await.unwrap();
    wait_until(&h, "both subscribed", |s| s.clients.iter().filter(|c| c.status.ready != 0).count() == 2).await;

    // Refused: another's reply and report, a command, the dispatcher's own tag.
    b0.publish("RC_REPLY", b"builder1 RUNNING ok").await.unwrap();
    b0.publish("RC_END", br#"{"name":"builder1"}"#).await.unwrap();
    b0.publish("RC_CMD", b"* STOP").await.unwrap();
    b0.publish(RC_GONE, b"builder1").await.unwrap();
    // A plain stranger: a forged reply, a subscription to commands, a data tag.
    let mut stranger = ChClient::connect(h.addr).await.unwrap();
    stranger.subscribe("RC_CMD", Mode::All).await.unwrap();
    stranger.publish("RC_REPLY", b"builder0 IDLE ok").await.unwrap();
    stranger.publish("DATA", b"plain data").await.unwrap();
    // Taken: its own reply; run control's command reaches it.
    b0.publish("RC_REPLY", b"builder0 RUNNING ok").await.unwrap();
    rc.publish("RC_CMD", b"builder0 STOP").await.unwrap();

    let s = wait_until(&h, "every refusal counted", |s| s.refused.iter().map(|r| r.count).sum::<u64>() == 6).await;
    assert_eq!(refused(&s, "builder0", "subject", "RC_REPLY"), 1);
    assert_eq!(refused(&s, "builder0", "subject", "RC_END"), 1);
    assert_eq!(refused(&s, "builder0", "role", "RC_CMD"), 1);
    assert_eq!(refused(&s, "builder0", "dispatcher", RC_GONE), 1);
    assert_eq!(refused(&s, "plain", "subscribe", "RC_CMD"), 1);
    assert_eq!(refused(&s, "plain", "plain", "RC_REPLY"), 1);
    assert_eq!(s.authenticated.get("tls"), Some(&2));
    // Run control got the plain data and builder0's own reply (from two connections: in
    // either order), nothing forged; builder0 got the command.
    let mut got = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(30), rc.next_message()).await.unwrap().unwrap();
        got.push((m.tag.to_string(), String::from_utf8_lossy(&m.payload).into_owned()));
    }
    got.sort();
    let want =
        [("DATA", "plain data"), ("RC_REPLY", "builder0 RUNNING ok")].map(|(t, p)| (t.to_string(), p.to_string()));
    assert_eq!(got, want);
    let m = tokio::time::timeout(Duration::from_secs(30), b0.next_message()).await.unwrap().unwrap();
    assert_eq!(&m.payload[..], b"builder0 STOP");

    // builder0's control connection closes: RC_GONE builder0, from the dispatcher.
    drop(b0);
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), rc.next_message()).await.unwrap().unwrap();
        if m.tag.to_string() == RC_GONE {
            assert_eq!(&m.payload[..], b"builder0");
            break;
        }
    }
    // A client that publishes and is gone at once: what it published is judged whole.
    let mut brief = ChClient::connect_with(h.addr, tls("source1", "source")).await.unwrap();
    for _ in 0..3 {
        brief.publish("RC_CMD", b"* STOP").await.unwrap();
    }
    drop(brief);
    wait_until(&h, "the brief client's refusals", |s| refused(s, "source1", "role", "RC_CMD") == 3).await;
    // A certificate of another CA gets no connection at all.
    let foreign = ClusterCa::generate("elsewhere", 1).unwrap();
    let config = identity(&foreign, &ca, "runcontrol", "runcontrol").client_config(&["dispatcher"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::IpAddress(h.addr.ip().into());
    if let Ok(mut s) = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await {
        // TLS 1.3: the server's refusal of our certificate comes at the first read.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = s.write_all(b"RC_CMD  ").await;
        let mut byte = [0u8; 1];
        assert!(!matches!(s.read(&mut byte).await, Ok(1)), "a foreign certificate was served");
    }
    wait_until(&h, "the foreign handshake refused", |s| s.rejected.get("tls_handshake").is_some_and(|n| *n >= 1)).await;
    cancel.cancel();
}
