//! Hostile clients on the HTTP server every shoal process uses (`httpd`): slowloris and
//! connection floods, while a well-behaved client keeps being served. Each server's
//! limits are chosen so that no step depends on how fast the machine is: where
//! connections must stay open, the header timeout is far out of reach.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use axum::{Router, routing::get};
use shoal_dispatcher::httpd::{HttpLimits, HttpStats, serve};
use socket2::{Domain, Socket, Type};
use tokio_util::sync::CancellationToken;

/// A connection from `from` (any 127.0.0.0/8 address) to `to`.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from((from, 0)).into()).unwrap();
    s.connect(&to.into()).unwrap();
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

fn get_from(from: Ipv4Addr, to: SocketAddr) -> String {
    let mut s = connect_from(from, to);
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// Reads until the server closes the connection (EOF or reset); false if it is still
/// open when the read timeout passes.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

struct Server {
    addr: SocketAddr,
    stats: Arc<HttpStats>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn start(rt: &tokio::runtime::Runtime, limits: HttpLimits) -> Server {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = Arc::new(HttpStats::default());
    let cancel = CancellationToken::new();
    let app = Router::new().route("/metrics", get(|| async { "shoal_up 1\n" }));
    let task = rt.spawn(serve(listener, app, limits, stats.clone(), "test", cancel.clone()));
    Server { addr, stats, cancel, task }
}

impl Server {
    fn stop(self, rt: &tokio::runtime::Runtime) {
        self.cancel.cancel();
        rt.block_on(self.task).unwrap().unwrap();
    }
}

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

#[test]
fn a_flood_from_one_address_is_refused_at_its_limit_while_others_are_served() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hour = Duration::from_secs(3600);
    let srv = start(&rt, HttpLimits { per_peer: 8, total: 64, header_timeout: hour, request_timeout: hour });
    // 8 connections (its limit) that never finish their headers ...
    let mut held: Vec<TcpStream> = (0..8).map(|_| connect_from(ATTACKER, srv.addr)).collect();
    for s in &mut held {
        s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: a").unwrap();
    }
    // ... and 20 more from the same address, closed at once.
    for _ in 0..20 {
        assert!(
            closed_by_server(&mut connect_from(ATTACKER, srv.addr)),
            "a connection beyond the peer's limit stays open"
        );
    }
    assert_eq!(HttpStats::get(&srv.stats.refused_per_peer), 20);
    // Meanwhile a well-behaved client is served.
    let reply = get_from(Ipv4Addr::LOCALHOST, srv.addr);
    assert!(reply.starts_with("HTTP/1.1 200") && reply.contains("shoal_up 1"), "{reply}");
    drop(held);
    srv.stop(&rt);
}

#[test]
fn a_flood_from_many_addresses_stops_at_the_total() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hour = Duration::from_secs(3600);
    let srv = start(&rt, HttpLimits { per_peer: 8, total: 16, header_timeout: hour, request_timeout: hour });
    let held: Vec<TcpStream> = (0..16u8).map(|i| connect_from(Ipv4Addr::new(127, 0, 1, i + 1), srv.addr)).collect();
    assert!(closed_by_server(&mut connect_from(Ipv4Addr::new(127, 0, 2, 1), srv.addr)));
    assert_eq!(HttpStats::get(&srv.stats.refused_total), 1);
    // Room again once they leave (the server sees them go).
    drop(held);
    let waiting = std::time::Instant::now();
    while HttpStats::get(&srv.stats.open) > 0 {
        assert!(waiting.elapsed() < Duration::from_secs(120), "the flood's places were never freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let reply = get_from(Ipv4Addr::LOCALHOST, srv.addr);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    srv.stop(&rt);
}

#[test]
fn slowloris_is_cut_by_the_header_timeout_and_its_address_served_again() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let limits =
        HttpLimits { per_peer: 8, total: 64, header_timeout: Duration::from_millis(300), ..HttpLimits::default() };
    let srv = start(&rt, limits);
    let mut slow: Vec<TcpStream> = (0..8).map(|_| connect_from(ATTACKER, srv.addr)).collect();
    for s in &mut slow {
        // A request line, then a header byte now and then: the headers never end.
        s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: a").unwrap();
        let _ = s.write_all(b"b");
    }
    for s in &mut slow {
        assert!(closed_by_server(s), "a slowloris connection was never closed");
    }
    assert_eq!(HttpStats::get(&srv.stats.connection_errors), 8, "{:?}", srv.stats);
    // Its places were freed before its sockets closed: the address is served at once.
    let reply = get_from(ATTACKER, srv.addr);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    srv.stop(&rt);
}
