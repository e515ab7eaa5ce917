//! `pubsub-bench`: one publisher to N subscribers through a message broker, for
//! `shoal dispatcher` (ControlHost), Redis pub/sub and NATS core pub/sub with the same
//! client structure.
//!
//! Both clients are raw protocol implementations over tokio TCP with `TCP_NODELAY`; the
//! publisher keeps at most `--window` messages ahead of the slowest subscriber, so neither
//! broker has to drop or disconnect anyone, and every subscriber must receive every
//! message (the run fails otherwise). Reports messages/s published and MB/s delivered.
//!
//! `--tls DIR` (a cluster CA's directory, `shoal ca init DIR`): every client of the shoal
//! target reaches a secured dispatcher (`shoal dispatcher --credentials`) over mutual TLS
//! with a `client` certificate the bench issues itself, which is the control plane's cost
//! (scripts/control_tls_cost.py).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Buf;
use clap::{Parser, ValueEnum};
use shoal_core::controlhost::{Tag, encode_prefix};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, WriteHalf};
use tokio::net::TcpStream;

/// A client connection: plain TCP, or TLS over it.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}
type Conn = Box<dyn Stream>;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Target {
    Shoal,
    Redis,
    Nats,
}

/// NATS: the client's greeting (no echo, no acknowledgements).
const NATS_CONNECT: &[u8] = b"CONNECT {\"verbose\":false,\"pedantic\":false,\"echo\":false,\"protocol\":1}\r\n";

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, value_enum)]
    target: Target,
    #[arg(long)]
    addr: SocketAddr,
    #[arg(long, default_value_t = 1)]
    subscribers: usize,
    /// Payload bytes per message (at least 1).
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// Messages to publish (default: about 1 GB delivered, between 50 and 100,000).
    #[arg(long)]
    messages: Option<u64>,
    /// Most messages the publisher may be ahead of the slowest subscriber ...
    #[arg(long, default_value_t = 64)]
    window: u64,
    /// ... and most bytes (Redis closes pub/sub clients with over 32 MB of output pending).
    #[arg(long, default_value_t = 8 << 20)]
    window_bytes: u64,
    /// The shoal target over mutual TLS: a cluster CA's directory to issue the bench's
    /// `client` certificate from.
    #[arg(long, value_name = "CA_DIR")]
    tls: Option<std::path::PathBuf>,
}

const CHANNEL: &str = "BENCH";

/// How clients connect: plain, or with a TLS connector.
#[derive(Clone)]
struct Connector {
    addr: SocketAddr,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Connector {
    fn new(addr: SocketAddr, ca_dir: Option<&std::path::Path>) -> anyhow::Result<Self> {
        let tls = match ca_dir {
            None => None,
            Some(dir) => {
                let ca = shoal_tls::ca::ClusterCa::load(dir)?;
                let issued = ca.issue(&shoal_tls::ca::IssueRequest::new("pubsub-bench", "client", &[], 1)?)?;
                let identity = shoal_tls::Identity::from_pem(
                    ca.cert_pem().as_bytes(),
                    issued.cert_pem.as_bytes(),
                    issued.key_pem.as_bytes(),
                )?;
                Some(tokio_rustls::TlsConnector::from(identity.client_config(&["dispatcher"])?))
            }
        };
        Ok(Self { addr, tls })
    }

    async fn connect(&self) -> anyhow::Result<Conn> {
        let addr = self.addr;
        let s = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        s.set_nodelay(true)?;
        Ok(match &self.tls {
            None => Box::new(s),
            Some(tls) => {
                let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
                Box::new(tls.connect(name, s).await.context("TLS handshake with the dispatcher")?)
            }
        })
    }
}

/// A subscriber connection of either protocol.
enum Sub {
    Shoal(BufReader<Conn>),
    Redis(BufReader<Conn>),
    Nats(BufReader<Conn>),
}

impl Sub {
    async fn open(target: Target, connector: &Connector) -> anyhow::Result<Sub> {
        let mut s = connector.connect().await?;
        match target {
            Target::Shoal => {
                // All-mode (lossless), like Redis pub/sub, which never drops a message for a
                // connected subscriber.
                let sub = format!(" a {CHANNEL}");
                for (tag, payload) in [(Tag::SUBSCRIBE, sub.as_bytes()), (Tag::ALWAYS, &b""[..])] {
                    s.write_all(&encode_prefix(tag, payload.len())).await?;
                    s.write_all(payload).await?;
                }
                s.flush().await?;
                Ok(Sub::Shoal(BufReader::with_capacity(256 * 1024, s)))
            }
            Target::Redis => {
                s.write_all(format!("*2\r\n$9\r\nSUBSCRIBE\r\n${}\r\n{CHANNEL}\r\n", CHANNEL.len()).as_bytes()).await?;
                let mut r = BufReader::with_capacity(256 * 1024, s);
                let confirm = read_resp_array(&mut r).await?;
                if confirm.first().map(|v| &v[..]) != Some(b"subscribe") {
                    bail!("unexpected reply to SUBSCRIBE");
                }
                Ok(Sub::Redis(r))
            }
            Target::Nats => {
                // The PONG proves the subscription is in place (the server handles a
                // connection's commands in order).
                s.write_all(NATS_CONNECT).await?;
                s.write_all(format!("SUB {CHANNEL} 1\r\nPING\r\n").as_bytes()).await?;
                let mut r = BufReader::with_capacity(256 * 1024, s);
                loop {
                    let line = read_line(&mut r).await?;
                    if line == b"PONG" {
                        break;
                    }
                    if line.starts_with(b"-ERR") {
                        bail!("NATS: {}", String::from_utf8_lossy(&line));
                    }
                }
                Ok(Sub::Nats(r))
            }
        }
    }

    /// The next message's payload.
    async fn next(&mut self, buf: &mut Vec<u8>) -> anyhow::Result<()> {
        match self {
            Sub::Shoal(r) => {
                let mut prefix = [0u8; 16];
                r.read_exact(&mut prefix).await?;
                let len = i32::from_be_bytes(prefix[8..12].try_into()?) as usize;
                buf.resize(len, 0);
                r.read_exact(buf).await?;
            }
            Sub::Redis(r) => {
                let mut parts = read_resp_array(r).await?;
                if parts.len() != 3 || parts[0] != b"message" {
                    bail!("unexpected push from Redis");
                }
                *buf = parts.pop().expect("three parts");
            }
            Sub::Nats(r) => loop {
                let line = read_line(r).await?;
                if line == b"PING" {
                    r.get_mut().write_all(b"PONG\r\n").await?;
                    continue;
                }
                if !line.starts_with(b"MSG ") {
                    bail!("unexpected from NATS: {}", String::from_utf8_lossy(&line));
                }
                let len: usize = std::str::from_utf8(line.rsplit(|&b| b == b' ').next().unwrap_or(b""))?.parse()?;
                buf.resize(len + 2, 0);
                r.read_exact(buf).await?;
                buf.truncate(len);
                break;
            },
        }
        Ok(())
    }
}

async fn read_line(r: &mut BufReader<Conn>) -> anyhow::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line).await?;
    if line.len() < 3 || !line.ends_with(b"\r\n") {
        bail!("connection closed or bad RESP line");
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

/// Reads one RESP array of bulk strings / integers (integers returned as their text).
async fn read_resp_array(r: &mut BufReader<Conn>) -> anyhow::Result<Vec<Vec<u8>>> {
    let head = read_line(r).await?;
    if head[0] != b'*' {
        bail!("expected a RESP array, got {:?}", String::from_utf8_lossy(&head));
    }
    let n: usize = std::str::from_utf8(&head[1..])?.parse()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let h = read_line(r).await?;
        match h[0] {
            b'$' => {
                let len: usize = std::str::from_utf8(&h[1..])?.parse()?;
                let mut v = vec![0u8; len + 2];
                r.read_exact(&mut v).await?;
                v.truncate(len);
                out.push(v);
            }
            b':' => out.push(h[1..].to_vec()),
            _ => bail!("unexpected RESP element"),
        }
    }
    Ok(out)
}

async fn publish(target: Target, s: &mut WriteHalf<Conn>, payload: &[u8]) -> anyhow::Result<()> {
    match target {
        Target::Shoal => {
            let prefix = encode_prefix(Tag::new(CHANNEL.as_bytes()).expect("valid"), payload.len());
            s.write_all_buf(&mut Buf::chain(&prefix[..], payload)).await?;
        }
        Target::Redis => {
            let head = format!("*3\r\n$7\r\nPUBLISH\r\n${}\r\n{CHANNEL}\r\n${}\r\n", CHANNEL.len(), payload.len());
            s.write_all_buf(&mut Buf::chain(Buf::chain(head.as_bytes(), payload), &b"\r\n"[..])).await?;
        }
        Target::Nats => {
            let head = format!("PUB {CHANNEL} {}\r\n", payload.len());
            s.write_all_buf(&mut Buf::chain(Buf::chain(head.as_bytes(), payload), &b"\r\n"[..])).await?;
        }
    }
    // A TLS stream holds a record until flushed.
    s.flush().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.payload == 0 || a.subscribers == 0 {
        bail!("--payload and --subscribers must be at least 1");
    }
    if a.tls.is_some() && !matches!(a.target, Target::Shoal) {
        bail!("--tls is for the shoal target");
    }
    let connector = Connector::new(a.addr, a.tls.as_deref())?;
    let m = a.messages.unwrap_or_else(|| (1_000_000_000 / (a.payload * a.subscribers) as u64).clamp(50, 100_000));
    let counts: Arc<Vec<AtomicU64>> = Arc::new((0..a.subscribers).map(|_| AtomicU64::new(0)).collect());
    let warm = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..a.subscribers {
        let mut sub = Sub::open(a.target, &connector).await?;
        let (counts, warm) = (counts.clone(), warm.clone());
        tasks.push(tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut warmed = false;
            let mut got = 0u64;
            while got < m {
                sub.next(&mut buf).await?;
                match buf.first() {
                    Some(0) if !warmed => {
                        warmed = true;
                        warm.fetch_add(1, Ordering::SeqCst);
                    }
                    Some(0) => {}
                    _ => {
                        got += 1;
                        counts[i].store(got, Ordering::Release);
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    // Redis answers every PUBLISH; drain the replies so the connection never stalls on
    // them (the dispatcher sends nothing to a pure publisher).
    let (mut rd, mut pubs) = tokio::io::split(connector.connect().await?);
    if let Target::Nats = a.target {
        pubs.write_all(NATS_CONNECT).await?;
    }
    let drain = tokio::spawn(async move {
        let mut sink = vec![0u8; 64 * 1024];
        while rd.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    // Subscriptions are not acknowledged by ControlHost: publish warm-up messages until
    // every subscriber has seen one (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    while warm.load(Ordering::SeqCst) < a.subscribers {
        if Instant::now() > deadline {
            bail!("subscribers not ready after 20 s");
        }
        publish(a.target, &mut pubs, &[0u8]).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let window = a.window.min(a.window_bytes / a.payload as u64).max(1);
    let mut payload = vec![1u8; a.payload];
    let start = Instant::now();
    let mut progress = (0u64, Instant::now());
    for i in 0..m {
        loop {
            let slowest = counts.iter().map(|c| c.load(Ordering::Acquire)).min().unwrap_or(0);
            if i - slowest.min(i) < window {
                break;
            }
            if slowest != progress.0 {
                progress = (slowest, Instant::now());
            } else if progress.1.elapsed() > Duration::from_secs(10) {
                bail!("no subscriber progress for 10 s at message {i} (slowest has {slowest})");
            }
            if let Some(t) = tasks.iter_mut().find(|t| t.is_finished()) {
                // A subscriber ended before receiving everything: report why.
                t.await??;
                bail!("a subscriber stopped early");
            }
            tokio::task::yield_now().await;
        }
        if a.payload >= 9 {
            payload[1..9].copy_from_slice(&i.to_le_bytes());
        }
        publish(a.target, &mut pubs, &payload).await?;
    }
    for t in tasks {
        t.await??;
    }
    let dt = start.elapsed().as_secs_f64();
    drain.abort();
    let delivered = (m as f64) * (a.payload as f64) * (a.subscribers as f64);
    println!(
        "{{\"target\":\"{:?}\",\"subscribers\":{},\"payload\":{},\"messages\":{},\"seconds\":{:.4},\"msgs_per_s\":{:.1},\"delivered_mb_per_s\":{:.1}}}",
        a.target,
        a.subscribers,
        a.payload,
        m,
        dt,
        m as f64 / dt,
        delivered / dt / 1e6
    );
    Ok(())
}
