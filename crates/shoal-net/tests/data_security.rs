//! The attack matrix's data-path rows (docs/security.md) against a real run: while sources,
//! a builder and the writer run with `security.data`, strangers dial the builder's data
//! port with a foreign CA's certificate, an expired one, the writer's (another role), and
//! plain frames. Each is refused in the handshake and counted; the run keeps every
//! fragment with its ledger balanced, and no stranger's byte reaches the frame reader.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use common::*;
use shoal_core::ledger::Ledger;
use shoal_net::builder::run_builder;
use shoal_net::source::run_source_node;
use shoal_net::transport::secure::{DataCredentials, REFUSED};
use shoal_net::writer::run_writer;
use shoal_tls::ca::{ClusterCa, IssueRequest};
use shoal_tls::{Connector, DataSecurity, Identity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn identity(ca: &ClusterCa, trusted: &ClusterCa, req: &IssueRequest) -> Identity {
    let issued = ca.issue(req).unwrap();
    Identity::from_pem(trusted.cert_pem().as_bytes(), issued.cert_pem.as_bytes(), issued.key_pem.as_bytes()).unwrap()
}

fn request(name: &str, role: &str) -> IssueRequest {
    IssueRequest::new(name, role, &["127.0.0.1".into()], 1).unwrap()
}

/// Dials `addr` as a stranger with `identity` and, if it gets through, sends frames: whether
/// the port took it.
async fn stranger(mode: DataSecurity, identity: Option<Identity>, addr: std::net::SocketAddr) -> bool {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let frame = shoal_core::frame::encode(
        &shoal_core::frame::FrameHeader {
            flags: shoal_core::frame::Flags::EMPTY,
            source: 0,
            hit_count: 0,
            slice: 1,
            slice_start: shoal_core::Instant::ZERO,
            send_time: shoal_core::Instant::ZERO,
            payload_len: 0,
        },
        &[],
    );
    let Some(identity) = identity else {
        // Plain frames, as a program that knows shoal's frame format but has no certificate.
        let mut tcp = tcp;
        let _ = tcp.write_all(&frame).await;
        let mut rest = Vec::new();
        let _ = tcp.read_to_end(&mut rest).await;
        return false;
    };
    let connector = Connector::new(mode, &identity, &["builder"]).unwrap();
    match connector.connect(tcp, addr).await {
        Err(_) => false,
        Ok(s) => {
            let (mut r, mut w) = s.into_split();
            let _ = w.write_all(&frame).await;
            // A refused TLS client learns of it at its first read.
            let mut byte = [0u8; 1];
            matches!(r.read(&mut byte).await, Ok(1))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_on_a_data_port_are_refused_and_the_run_keeps_every_fragment() {
    let ca = ClusterCa::generate("test", 1).unwrap();
    let foreign = ClusterCa::generate("elsewhere", 1).unwrap();
    let own =
        DataCredentials::of_roles(["source", "builder", "writer"].map(|r| identity(&ca, &ca, &request(r, r)))).unwrap();
    let mut expired = request("source0", "source");
    expired.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(3);
    expired.not_after = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    for mode in [DataSecurity::Authenticated, DataSecurity::Tls] {
        let out = temp_dir(&format!("data-security-{}", mode.as_str()));
        let mut cfg = small_config(2, 1, 1.0, &out);
        cfg.security.data = mode;
        cfg.security.credentials = own.clone();
        let (wl, mut bls) = bind_all(&mut cfg).await;
        let addr = bls[0].local_addr().unwrap();
        let before = REFUSED.snapshot();
        let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
        let builder = tokio::spawn(run_builder(
            shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
            bls.remove(0),
            clock(),
            live(),
            never(),
        ));
        let strangers = [
            ("a foreign CA's certificate", Some(identity(&foreign, &ca, &request("source0", "source")))),
            ("an expired certificate", Some(identity(&ca, &ca, &expired))),
            ("the writer's certificate", Some(identity(&ca, &ca, &request("writer", "writer")))),
            ("plain frames", None),
        ];
        let attacks = tokio::spawn(async move {
            let mut taken = Vec::new();
            for (what, id) in strangers {
                if stranger(mode, id, addr).await {
                    taken.push(what);
                }
            }
            taken
        });
        let sources = run_source_node(cfg.clone(), vec![0, 1], clock(), live(), never()).await.unwrap();
        let taken = attacks.await.unwrap();
        let b = builder.await.unwrap().unwrap();
        let w = writer.await.unwrap().unwrap();
        assert!(taken.is_empty(), "{mode:?}: the data port took {taken:?}");
        assert!(w.error.is_none());
        let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
        assert!(ledger.is_balanced(), "{ledger:?}");
        assert_eq!(ledger.lost(), 0, "{mode:?}: the real sources lost fragments: {ledger:?}");
        assert!(b.node.slices_complete > 0 && b.node.slices_incomplete == 0, "{:?}", b.node);
        // Nothing of the strangers reached the frame reader: refused before it.
        assert!(b.node.rejected_connections.is_empty(), "{:?}", b.node.rejected_connections);
        let after = REFUSED.snapshot();
        let delta = |kind: &str| {
            let get = |s: &[(&str, u64); 3]| s.iter().find(|(k, _)| *k == kind).unwrap().1;
            get(&after) - get(&before)
        };
        assert_eq!(delta("certificate"), 3, "{mode:?}: {after:?}");
        assert_eq!(delta("not_tls"), 1, "{mode:?}: {after:?}");
        // The source node's link (one for both sources) and the builder's to the writer.
        assert!(REFUSED.accepted.load(Ordering::Relaxed) >= 2, "the real peers got through");
        std::fs::remove_dir_all(&out).unwrap();
    }
}
