//! `shoal dispatcher` as its own process serves 10,000 idle connections and still routes.
//! (A separate process: client and server ends of 10,000 connections would not fit in one
//! process's descriptor limit here.)

mod common;
use common::free_port;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn frame(tag: &str, payload: &[u8]) -> Vec<u8> {
    let mut f = format!("{tag:\0<8}").into_bytes();
    f.extend_from_slice(&(payload.len() as i32).to_be_bytes());
    f.extend_from_slice(&[0; 4]);
    f.extend_from_slice(payload);
    f
}

fn http_get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn connect_retry(port: u16) -> TcpStream {
    for _ in 0..500 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("dispatcher did not come up");
}

#[test]
fn ten_thousand_idle_connections() {
    let (port, http) = (free_port(), free_port());
    let _d = Kill(
        Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(["dispatcher", "--listen", &format!("127.0.0.1:{port}"), "--http", &format!("127.0.0.1:{http}")])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut sub = connect_retry(port);
    connect_retry(http);
    let idle: Vec<TcpStream> = (0..10_000).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    sub.write_all(&frame("_Subscri", b" a ALIVE")).unwrap();
    sub.write_all(&frame("_Always", b"")).unwrap();
    // Wait (bounded) until the dispatcher has registered every connection and the subscription.
    let mut status = String::new();
    for _ in 0..600 {
        status = http_get(http, "/status");
        if status.matches("\"subscription\"").count() >= 10_001 && status.contains("a ALIVE") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(status.matches("\"subscription\"").count() >= 10_001, "not all clients registered");
    let mut publisher = TcpStream::connect(("127.0.0.1", port)).unwrap();
    publisher.write_all(&frame("ALIVE", b"still routing")).unwrap();
    sub.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut got = [0u8; 16 + 13];
    sub.read_exact(&mut got).unwrap();
    assert_eq!(&got[16..], b"still routing");
    let metrics = http_get(http, "/metrics");
    assert!(metrics.contains("shoal_dispatcher_clients 10002"), "{}", &metrics[..metrics.len().min(2000)]);
    drop(idle);

    // 10,000 idle connections on its HTTP port (the attack matrix's row; the descriptors of
    // the first 10,000 are given back first): those over the per-address limit are closed
    // at once, and a client from another address is still answered.
    let idle_http: Vec<TcpStream> = (0..10_000).filter_map(|_| TcpStream::connect(("127.0.0.1", http)).ok()).collect();
    assert!(idle_http.len() >= 9_000, "only {} connected", idle_http.len());
    let other = std::net::SocketAddr::from(([127, 0, 0, 2], 0));
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&other.into()).unwrap();
    sock.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], http)).into()).unwrap();
    let mut s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET /status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{}", &out[..out.len().min(300)]);
    // Most of the flood was closed by the server (a read sees the end at once).
    let closed = idle_http
        .iter()
        .take(200)
        .filter(|c| {
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            // Held ones (at most 32 of this address) time out here instead.
            match (&**c).read(&mut [0u8; 1]) {
                Ok(0) => true,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                Ok(_) => false,
            }
        })
        .count();
    assert!(closed >= 150, "only {closed} of the first 200 idle HTTP connections were closed");
}
