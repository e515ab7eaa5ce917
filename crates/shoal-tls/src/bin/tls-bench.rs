//! Limits of the bulk path's security on this machine (docs/benchmarks.md, "Security"):
//!
//! - `tls-bench aead [--mb N]`: rustls' own rate on one core, both ends of one TLS 1.3
//!   connection in memory on one thread (the sender's encryption and the receiver's
//!   decryption of every byte, no socket): the ceiling of `data = "tls"` per core;
//! - `tls-bench handshakes [--count N] [--mode authenticated|tls] [--concurrency C]`: N
//!   connections over loopback, each with its handshake (both certificates checked, as a
//!   source's to a builder), C at once; the wall time, the rate and the process's CPU time.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use shoal_tls::ca::{ClusterCa, IssueRequest};
use shoal_tls::data::{Acceptor, Connector, DataSecurity};
use shoal_tls::identity::Identity;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.into())
}

fn identity(ca: &ClusterCa, role: &str) -> anyhow::Result<Identity> {
    let issued = ca.issue(&IssueRequest::new(role, role, &["127.0.0.1".into()], 1)?)?;
    Identity::from_pem(ca.cert_pem().as_bytes(), issued.cert_pem.as_bytes(), issued.key_pem.as_bytes())
}

/// The process's user and system time so far.
fn cpu_seconds() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) else { return f64::NAN };
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(u.user_time()) + t(u.system_time())
}

fn aead(mb: usize) -> anyhow::Result<()> {
    let ca = ClusterCa::generate("bench", 1)?;
    let client_cfg = identity(&ca, "source")?.client_config(&["builder"])?;
    let server_cfg = identity(&ca, "builder")?.server_config(&["source"])?;
    let name = rustls::pki_types::ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let mut client = rustls::ClientConnection::new(client_cfg, name)?;
    let mut server = rustls::ServerConnection::new(server_cfg)?;
    // Whole megabytes at a time: no plaintext limit in the way.
    client.set_buffer_limit(None);
    server.set_buffer_limit(None);
    // The handshake, in memory.
    let mut wire = Vec::new();
    while client.is_handshaking() || server.is_handshaking() {
        wire.clear();
        client.write_tls(&mut wire)?;
        server.read_tls(&mut wire.as_slice())?;
        server.process_new_packets()?;
        wire.clear();
        server.write_tls(&mut wire)?;
        client.read_tls(&mut wire.as_slice())?;
        client.process_new_packets()?;
    }
    let suite = client.negotiated_cipher_suite().map(|s| format!("{:?}", s.suite())).unwrap_or_default();
    let chunk = vec![0x5au8; 1 << 20];
    let mut sink = vec![0u8; 1 << 20];
    let total = mb << 20;
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut moved = 0usize;
    while moved < total {
        client.writer().write_all(&chunk)?;
        wire.clear();
        while client.wants_write() {
            client.write_tls(&mut wire)?;
        }
        let mut rd = wire.as_slice();
        while !rd.is_empty() {
            server.read_tls(&mut rd)?;
            server.process_new_packets()?;
            loop {
                match server.reader().read(&mut sink) {
                    Ok(0) => break,
                    Ok(n) => moved += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    println!(
        "aead {suite}: {mb} MiB encrypted and decrypted on one thread in {wall:.3} s: {:.0} MB/s ({:.2} CPU-s per GB)",
        moved as f64 / wall / 1e6,
        cpu / (moved as f64 / 1e9)
    );
    Ok(())
}

async fn handshakes(count: usize, mode: DataSecurity, concurrency: usize) -> anyhow::Result<()> {
    let ca = ClusterCa::generate("bench", 1)?;
    let acceptor = Acceptor::new(mode, &identity(&ca, "builder")?, &["source"])?;
    let connector = Connector::new(mode, &identity(&ca, "source")?, &["builder"])?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let mut done = tokio::task::JoinSet::new();
        for _ in 0..count {
            let (tcp, _) = listener.accept().await?;
            let a = acceptor.clone();
            done.spawn(async move { a.accept(tcp).await.is_ok() });
        }
        let mut ok = 0usize;
        while let Some(r) = done.join_next().await {
            ok += usize::from(r.unwrap_or(false));
        }
        anyhow::Ok(ok)
    });
    let room = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..count {
        let permit = room.clone().acquire_owned().await?;
        let c = connector.clone();
        clients.spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
            let s = c.connect(tcp, addr).await.ok();
            drop(permit);
            s.map(|_| ())
        });
    }
    let mut ok = 0usize;
    while let Some(r) = clients.join_next().await {
        ok += usize::from(matches!(r, Ok(Some(()))));
    }
    let accepted = server.await??;
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    println!(
        "handshakes ({}): {ok} of {count} connected, {accepted} accepted, {concurrency} at once, in {wall:.2} s: \
         {:.0} per s, {:.0} us CPU each (both ends)",
        mode.as_str(),
        count as f64 / wall,
        cpu / count as f64 * 1e6
    );
    if ok != count || accepted != count {
        anyhow::bail!("not every handshake succeeded");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some("aead") => aead(arg("--mb", "1024").parse()?),
        Some("handshakes") => {
            let mode = match arg("--mode", "authenticated").as_str() {
                "tls" => DataSecurity::Tls,
                "authenticated" => DataSecurity::Authenticated,
                m => anyhow::bail!("--mode {m:?}: authenticated or tls"),
            };
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(handshakes(arg("--count", "10000").parse()?, mode, arg("--concurrency", "64").parse()?))
        }
        _ => {
            eprintln!(
                "usage: tls-bench aead [--mb N] | handshakes [--count N] [--mode authenticated|tls] [--concurrency C]"
            );
            std::process::exit(2)
        }
    }
}
