//! The attack matrix's data-path rows (docs/security.md) against a real run: while sources,
//! a builder and the writer run with `security.data`, strangers dial the builder's data
//! port with a foreign CA's certificate, an expired one, the writer's (another role), and
//! plain frames. Each is refused in the handshake and counted. Insiders with real
//! certificates of the cluster are cut off at their first frame for another's id: a
//! source's sending another source's fragment or end of stream, a builder's ending another
//! builder's stream at the writer, and one naming no process of the cluster is refused at
//! once. The run keeps every fragment with its ledger balanced, and no stranger's byte
//! reaches the frame reader. A flood of connections from one address cannot lock the
//! sources out of their port.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use common::*;
use shoal_core::ledger::Ledger;
use shoal_net::builder::run_builder;
use shoal_net::source::run_source_node;
use shoal_net::transport::secure::{DATA_REFUSED, DataCredentials, REFUSED};
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

/// A data frame of `source` for `slice` (`END_OF_STREAM`: its end of stream).
fn frame(flags: shoal_core::frame::Flags, source: u32, slice: u64) -> bytes::Bytes {
    shoal_core::frame::encode(
        &shoal_core::frame::FrameHeader {
            flags,
            source,
            hit_count: 0,
            slice,
            slice_start: shoal_core::Instant::ZERO,
            send_time: shoal_core::Instant::ZERO,
            payload_len: 0,
        },
        &[],
    )
}

/// Dials `addr` (a port taking `port_role`) with `identity` and, if it gets through, sends
/// `frame`: whether the port kept the connection open after it (a refused TLS client, or
/// one cut off for what it sent, learns of it at its first read).
async fn dial(
    mode: DataSecurity,
    identity: Option<Identity>,
    addr: std::net::SocketAddr,
    port_role: &str,
    frame: &[u8],
) -> bool {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let Some(identity) = identity else {
        // Plain frames, as a program that knows shoal's frame format but has no certificate.
        let mut tcp = tcp;
        let _ = tcp.write_all(frame).await;
        let mut rest = Vec::new();
        let _ = tcp.read_to_end(&mut rest).await;
        return false;
    };
    let connector = Connector::new(mode, &identity, &[port_role]).unwrap();
    match connector.connect(tcp, addr).await {
        Err(_) => false,
        Ok(s) => {
            let (mut r, mut w) = s.into_split();
            let _ = w.write_all(frame).await;
            let mut byte = [0u8; 1];
            matches!(r.read(&mut byte).await, Ok(1))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_insiders_on_the_data_ports_are_refused_and_the_run_keeps_every_fragment() {
    use shoal_core::frame::Flags;
    let ca = ClusterCa::generate("test", 1).unwrap();
    let foreign = ClusterCa::generate("elsewhere", 1).unwrap();
    let own =
        DataCredentials::of_roles(["source", "builder", "writer"].map(|r| identity(&ca, &ca, &request(r, r)))).unwrap();
    let mut expired = request("source0", "source");
    expired.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(3);
    expired.not_after = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    // The cluster's processes: the run's source node (both sources) and builder, and two
    // processes whose real certificates speak for ids of their own only.
    let peers = shoal_net::transport::secure::Peers::from([
        ("source".into(), vec![0, 1]),
        ("builder".into(), vec![0]),
        ("source7".into(), vec![7]),
        ("builder3".into(), vec![3]),
    ]);
    for mode in [DataSecurity::Authenticated, DataSecurity::Tls] {
        let out = temp_dir(&format!("data-security-{}", mode.as_str()));
        let mut cfg = small_config(2, 1, 1.0, &out);
        cfg.security.data = mode;
        cfg.security.credentials = own.clone();
        cfg.security.peers = peers.clone();
        let (wl, mut bls) = bind_all(&mut cfg).await;
        let addr = bls[0].local_addr().unwrap();
        let writer_addr = wl.local_addr().unwrap();
        let (before, refused_before) = (REFUSED.snapshot(), DATA_REFUSED.snapshot());
        let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
        let builder = tokio::spawn(run_builder(
            shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap(),
            bls.remove(0),
            clock(),
            live(),
            never(),
        ));
        let id = |req: IssueRequest| Some(identity(&ca, &ca, &req));
        let fragment = frame(Flags::EMPTY, 0, 1);
        let attacks = [
            ("a foreign CA's certificate", Some(identity(&foreign, &ca, &request("source0", "source"))), &fragment),
            ("an expired certificate", id(expired.clone()), &fragment),
            ("the writer's certificate", id(request("writer", "writer")), &fragment),
            ("plain frames", None, &fragment),
            // Insiders: certificates of the cluster CA.
            ("a source of no process of the cluster", id(request("source9", "source")), &fragment),
            ("source7's certificate sending source 0's fragment", id(request("source7", "source")), &fragment),
            (
                "source7's certificate ending source 1's stream",
                id(request("source7", "source")),
                &frame(Flags::END_OF_STREAM, 1, 0),
            ),
        ];
        let mut taken = Vec::new();
        for (what, identity, frame) in attacks {
            if dial(mode, identity, addr, "builder", frame).await {
                taken.push(what);
            }
        }
        // A builder's certificate on the writer's port, ending another builder's stream.
        let builder3 = id(request("builder3", "builder"));
        if dial(mode, builder3, writer_addr, "writer", &frame(Flags::END_OF_STREAM, 0, 0)).await {
            taken.push("builder3's certificate ending builder 0's stream on the writer's port");
        }
        let sources = run_source_node(cfg.clone(), vec![0, 1], clock(), live(), never()).await.unwrap();
        let b = builder.await.unwrap().unwrap();
        let w = writer.await.unwrap().unwrap();
        assert!(taken.is_empty(), "{mode:?}: the data ports took {taken:?}");
        assert!(w.error.is_none());
        let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
        assert!(ledger.is_balanced(), "{ledger:?}");
        assert_eq!(ledger.lost(), 0, "{mode:?}: the real sources lost fragments: {ledger:?}");
        assert!(b.node.slices_complete > 0 && b.node.slices_incomplete == 0, "{:?}", b.node);
        // Nothing of the strangers reached the frame reader (refused before it); each
        // insider was cut off at its first frame, for its identity.
        let cut = BTreeMap::from([("identity".to_string(), 2u64)]);
        assert_eq!(b.node.rejected_connections, cut, "{mode:?}");
        assert_eq!(w.rejected_connections, BTreeMap::from([("identity".to_string(), 1u64)]), "{mode:?}");
        assert_eq!(w.builders_ended, 1, "{mode:?}: only the real builder ended its stream");
        let after = REFUSED.snapshot();
        let delta = |kind: &str| {
            let get = |s: &[(&str, u64); 3]| s.iter().find(|(k, _)| *k == kind).unwrap().1;
            get(&after) - get(&before)
        };
        assert_eq!(delta("certificate"), 3, "{mode:?}: {after:?}");
        assert_eq!(delta("not_tls"), 1, "{mode:?}: {after:?}");
        let identity_refused = DATA_REFUSED.snapshot()[0].1 - refused_before[0].1;
        assert_eq!(identity_refused, 4, "{mode:?}: source9 at the handshake, three insiders at their frame");
        // The source node's link (one for both sources) and the builder's to the writer.
        assert!(REFUSED.accepted.load(Ordering::Relaxed) >= 2, "the real peers got through");
        std::fs::remove_dir_all(&out).unwrap();
    }
    a_flood_from_one_address_cannot_lock_the_sources_out().await;
    udp_datagrams_carry_the_run_s_mac().await;
}

/// A run secured `authenticated` (over `transport`) whose writer and builder are running:
/// its configuration, output directory, the builder's address and the two tasks.
struct SecuredRun {
    cfg: shoal_net::config::Config,
    out: std::path::PathBuf,
    addr: std::net::SocketAddr,
    writer: tokio::task::JoinHandle<anyhow::Result<shoal_net::writer::WriterReport>>,
    builder: tokio::task::JoinHandle<Result<shoal_net::builder::BuilderReport, shoal_net::config::ConfigError>>,
}

impl SecuredRun {
    async fn start(name: &str, transport: &str) -> SecuredRun {
        let ca = ClusterCa::generate("test", 1).unwrap();
        let roles = ["source", "builder", "writer"].map(|r| identity(&ca, &ca, &request(r, r)));
        let out = temp_dir(name);
        let mut cfg = small_config(2, 1, 1.0, &out);
        cfg.run.transport = transport.into();
        cfg.security.data = DataSecurity::Authenticated;
        cfg.security.credentials = DataCredentials::of_roles(roles).unwrap();
        cfg.security.peers =
            shoal_net::transport::secure::Peers::from([("source".into(), vec![0, 1]), ("builder".into(), vec![0])]);
        cfg.security.udp_key = shoal_net::transport::udp::mac::DatagramMac::new_key_hex().unwrap();
        let (wl, mut bls) = bind_all(&mut cfg).await;
        let addr = bls[0].local_addr().unwrap();
        let writer = tokio::spawn(run_writer(cfg.clone(), wl, never()));
        let settings = shoal_net::builder::BuilderSettings::from_config(&cfg, 0).unwrap();
        let builder = tokio::spawn(run_builder(settings, bls.remove(0), clock(), live(), never()));
        SecuredRun { cfg, out, addr, writer, builder }
    }

    /// Runs the sources to the end; the builder's report, once the run kept every
    /// fragment with its ledger balanced.
    async fn finish(self) -> shoal_net::builder::BuilderReport {
        let sources = run_source_node(self.cfg.clone(), vec![0, 1], clock(), live(), never()).await.unwrap();
        let b = self.builder.await.unwrap().unwrap();
        self.writer.await.unwrap().unwrap();
        let ledger = Ledger::combine(&sources.tallies, &BTreeMap::from([(0, b.node.tally.clone())]));
        assert!(ledger.is_balanced() && ledger.lost() == 0, "{ledger:?}");
        assert!(b.node.slices_complete > 0 && b.node.slices_incomplete == 0, "{:?}", b.node);
        std::fs::remove_dir_all(&self.out).unwrap();
        b
    }
}

/// A flood of connections from one address while a secured run starts: the sources get
/// their places (run after the first test's rows: both read process-wide counters).
async fn a_flood_from_one_address_cannot_lock_the_sources_out() {
    use shoal_net::transport::listen::PER_ADDRESS;
    let run = SecuredRun::start("data-security-flood", "tcp").await;
    // 300 connections from 127.0.0.2 that never begin their handshake: more than every place
    // of the port (2 sources + 256), each held until its handshake's 10 s run out.
    let mut flood = Vec::new();
    for _ in 0..300 {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        flood.push(s.connect(run.addr).await.unwrap());
    }
    // The sources connect (from 127.0.0.1) while the flood holds what it may.
    let b = run.finish().await;
    let limited = b.node.rejected_connections.get("connection_limit").copied().unwrap_or(0);
    let rejected = &b.node.rejected_connections;
    assert_eq!(limited, 300 - PER_ADDRESS as u64, "one address held {PER_ADDRESS} places: {rejected:?}");
    drop(flood);
}

/// `data` with the datagram transport: every datagram carries the run's MAC, and a
/// stranger's datagrams (well-formed ones among them) are dropped and counted before the
/// builder reads them, while the run keeps every fragment.
async fn udp_datagrams_carry_the_run_s_mac() {
    let run = SecuredRun::start("data-security-udp", "udp").await;
    // A stranger's datagrams to the builder's port: well-formed ones without the MAC, and
    // one sealed under another key.
    let stranger = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let number = run.cfg.run.run_number as u32;
    for slice in 0..40 {
        stranger.send_to(&shoal_core::datagram::Datagram::request(number, 0, 0, slice), run.addr).await.unwrap();
    }
    let other = shoal_net::transport::udp::mac::DatagramMac::from_hex(&"ab".repeat(32)).unwrap();
    stranger.send_to(&other.seal(b"a datagram under another key"), run.addr).await.unwrap();
    let b = run.finish().await;
    assert_eq!(b.udp.as_ref().expect("a datagram run").mac_refused, 41);
}
