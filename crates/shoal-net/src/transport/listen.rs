//! Listening sockets for data ports with a deep accept queue.
//!
//! tokio's `TcpListener::bind` asks for a backlog of 1,024. A run whose sources all
//! connect at once (thousands of source nodes) overflows it; Linux then drops the
//! handshake's last ACK while the client already counts the connection as open, writes its
//! data into its own socket buffer and closes, and the data never reaches the builder.
//! Data ports ask for the kernel's most (`net.core.somaxconn`, 4,096 by default).
//!
//! A builder that holds free-running sources back (`crate::builder::hold`) leaves their data in
//! the kernel, and the kernel's TCP memory is one pool for every socket of the host
//! (`net.ipv4.tcp_mem`). Thousands of held connections, each with the default receive
//! buffer, fill it: the kernel then drops what arrives on the connection the builder waits
//! for, and the builder waits for ever ([`KernelShare`]).

use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;

/// The accept queue asked for; the kernel caps it at `net.core.somaxconn`.
pub const BACKLOG: i32 = 65_535;

/// Binds `addr` (address reuse on, so a restarted process gets its port back at once) and
/// listens with [`BACKLOG`].
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// A builder's data port: its TCP listener and, for the datagram transport, the UDP
/// socket on the same address and port.
///
/// Both are bound together ([`bind_data_port`]): a UDP socket bound later to the TCP
/// listener's port number can find it taken, since any socket of the host may have got
/// that number as its own ephemeral UDP port in between (seen once in a test run).
#[derive(Debug)]
pub struct DataPort {
    pub tcp: TcpListener,
    /// Non-blocking; `None` for TCP, or where the caller bound only the listener (then
    /// the builder binds UDP itself, on the listener's port).
    pub udp: Option<std::net::UdpSocket>,
}

impl DataPort {
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

impl From<TcpListener> for DataPort {
    fn from(tcp: TcpListener) -> Self {
        Self { tcp, udp: None }
    }
}

/// Attempts at a free pair of ports (TCP and UDP with one number) when the port is left to
/// the kernel: each fails only if another socket took that UDP number, so a few are plenty.
pub const PAIR_ATTEMPTS: usize = 64;

/// Binds a data port at `addr` ([`bind`]), with a UDP socket with `udp_buffer` bytes of
/// buffers on the same port where `udp_buffer` is given. With port 0 a UDP number already
/// taken makes it try another port ([`PAIR_ATTEMPTS`]); with a fixed port it is an error.
pub fn bind_data_port(addr: SocketAddr, udp_buffer: Option<usize>) -> std::io::Result<DataPort> {
    bind_pair(addr, udp_buffer.is_some(), |at| {
        let s = crate::transport::udp::std_socket(at, udp_buffer.unwrap_or_default())?;
        s.set_nonblocking(true)?;
        Ok(s)
    })
    .map(|(tcp, udp)| DataPort { tcp, udp })
}

/// [`bind_data_port`]'s loop, with the UDP bind passed in (tests make it fail).
fn bind_pair<U>(
    addr: SocketAddr,
    with_udp: bool,
    mut bind_udp: impl FnMut(SocketAddr) -> std::io::Result<U>,
) -> std::io::Result<(TcpListener, Option<U>)> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let tcp = bind(addr)?;
        if !with_udp {
            return Ok((tcp, None));
        }
        let at = tcp.local_addr()?;
        match bind_udp(at) {
            Ok(udp) => return Ok((tcp, Some(udp))),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && addr.port() == 0 && attempts < PAIR_ATTEMPTS => {
                tracing::debug!(port = at.port(), "UDP port taken; another pair");
            }
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("binding UDP {at} (after {attempts} attempts): {e}"),
                ));
            }
        }
    }
}

/// The receive buffer each of a builder's held data connections may take, so that all of
/// them together stay within half the kernel's TCP memory before pressure.
///
/// Measured (docs/benchmarks.md "Connection scaling"): 10,000 saturating sources sending
/// 4 GB to one builder on this 24-GiB machine (pressure at 1.5 GB) filled the pool within
/// 15 s; the kernel dropped every segment of the connection the oldest slice waited for,
/// the builder waited with 1.7 GB in socket queues, and the sources, having exited, lost
/// their unsent data when the kernel gave up on them. Asking for 64 kB a connection (1.3 GB
/// in all, which the kernel doubles) the same run stalled too; 32 and 39 kB (0.42 and 0.5
/// of the pool) completed. Smaller buffers cost the builder CPU at 10,000 connections (13 %
/// more per GB with half the pool, about a quarter with a quarter; docs/benchmarks.md), so
/// the share is the larger of the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShare {
    /// `net.ipv4.tcp_mem`'s pressure threshold, in bytes.
    pub pressure_bytes: u64,
    /// `net.ipv4.tcp_rmem`'s default, the buffer a connection starts with.
    pub default_receive: u64,
}

/// Smallest receive buffer set: a few 4-kB fragments with their headers.
pub const MIN_HELD_RECEIVE_BUFFER: usize = 16 << 10;

impl KernelShare {
    /// This host's figures, from `/proc/sys/net/ipv4` (`None` where they cannot be read).
    pub fn of_this_host() -> Option<Self> {
        let read = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).ok();
        let field = |text: &str, i: usize| text.split_whitespace().nth(i)?.parse::<u64>().ok();
        let pressure_pages = field(&read("tcp_mem")?, 1)?;
        let default_receive = field(&read("tcp_rmem")?, 1)?;
        Some(Self { pressure_bytes: pressure_pages * page_size(), default_receive })
    }

    /// The receive buffer to ask for (`SO_RCVBUF`) when `connections` may be held at once;
    /// `None` where the default fits (then the kernel's autotuning stays on).
    pub fn receive_buffer(&self, connections: u64) -> Option<usize> {
        // SO_RCVBUF's value is doubled by the kernel for its bookkeeping: a connection can
        // take twice what is asked.
        let each = self.pressure_bytes / 2 / connections.max(1) / 2;
        (2 * each < self.default_receive).then(|| (each as usize).max(MIN_HELD_RECEIVE_BUFFER))
    }
}

/// The receive buffer for `connections` held data connections (`builder.held_receive_buffer`):
/// `asked` bytes, or with 0 this host's share ([`KernelShare::receive_buffer`]); `None`:
/// the kernel's default and autotuning.
pub fn held_receive_buffer(asked: u64, connections: u64) -> Option<usize> {
    match asked {
        0 => KernelShare::of_this_host()?.receive_buffer(connections),
        asked => Some(asked as usize),
    }
}

/// Sets the listener's receive buffer (`SO_RCVBUF`, which accepted connections inherit).
pub fn set_receive_buffer(listener: &TcpListener, size: usize) -> std::io::Result<()> {
    socket2::SockRef::from(listener).set_recv_buffer_size(size)
}

#[allow(unsafe_code)]
fn page_size() -> u64 {
    // SAFETY: sysconf takes an integer and reads no memory of the process.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

/// How long a new data connection has to deliver its first whole frame before it is closed
/// (`no_frame_in_time`): a connection that says nothing holds a descriptor for nothing.
/// Sources send a hello or a fragment within a slice or two of connecting (slices are at
/// most 4 s).
pub const FIRST_FRAME_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Most connections a data port keeps open at once, and who may hold them.
///
/// Every connection takes a *pending* place when accepted: at most `expected + 256` of them
/// at once, and on a port whose peers prove who they are (`[security] data`) at most
/// [`PER_ADDRESS`] from one address. A connection whose handshake names a process of the
/// cluster ([`ConnectionPlace::identify`]) gives its pending place back for one of that
/// process's own ([`PER_PEER`] each), which no stranger can take: strangers share the
/// pending places, one address a bounded part of them, and a source that reconnects while
/// someone floods the port finds room for its handshake and keeps its place after it.
/// Beyond, a new connection is closed at once and counted (`connection_limit`), so a flood
/// cannot take the process's descriptors from its data path; connections that never finish
/// their handshake leave within its 10 s, those that never send a frame within
/// [`FIRST_FRAME_WITHIN`], making room again.
#[derive(Clone, Debug)]
pub struct ConnectionLimit {
    places: std::sync::Arc<std::sync::Mutex<Places>>,
    limit: usize,
}

/// Most pending places one address holds on a port whose peers prove who they are.
pub const PER_ADDRESS: usize = 64;
/// Most places one process of the cluster holds (a reconnection may overlap the end of its
/// connection before).
pub const PER_PEER: usize = 4;

#[derive(Debug, Default)]
struct Places {
    pending: usize,
    by_address: std::collections::HashMap<std::net::IpAddr, usize>,
    peers: std::collections::HashMap<String, usize>,
    /// Pending places one address may hold (none: no bound but the total).
    per_address: Option<usize>,
}

impl ConnectionLimit {
    /// A port expecting up to `expected` legitimate connections: pending places for them
    /// and 256 more (reconnections whose old connection is not yet seen closed, monitoring).
    pub fn new(expected: usize) -> Self {
        Self { places: Default::default(), limit: expected + 256 }
    }

    /// [`ConnectionLimit::identifying`] where `identifies`, else [`ConnectionLimit::new`].
    pub fn for_port(expected: usize, identifies: bool) -> Self {
        if identifies { Self::identifying(expected) } else { Self::new(expected) }
    }

    /// The same, on a port whose peers prove who they are: one address holds at most
    /// [`PER_ADDRESS`] pending places.
    pub fn identifying(expected: usize) -> Self {
        let limit = Self::new(expected);
        limit.places.lock().expect("places").per_address = Some(PER_ADDRESS);
        limit
    }

    /// A pending place for a new connection from `addr` (given back when dropped), or
    /// `None` at the limit.
    pub fn admit(&self, addr: std::net::IpAddr) -> Option<ConnectionPlace> {
        let mut p = self.places.lock().expect("places");
        let from_addr = p.by_address.get(&addr).copied().unwrap_or(0);
        if p.pending >= self.limit || p.per_address.is_some_and(|n| from_addr >= n) {
            return None;
        }
        p.pending += 1;
        *p.by_address.entry(addr).or_default() += 1;
        Some(ConnectionPlace { places: self.places.clone(), held: Held::Pending(addr) })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// A place among a port's connections, given back when dropped ([`ConnectionLimit::admit`]).
#[derive(Debug)]
pub struct ConnectionPlace {
    places: std::sync::Arc<std::sync::Mutex<Places>>,
    held: Held,
}

#[derive(Debug)]
enum Held {
    Pending(std::net::IpAddr),
    Peer(String),
    Released,
}

impl ConnectionPlace {
    /// The connection's handshake named process `name` of the cluster: its pending place
    /// becomes one of `name`'s own. False (the place stays pending) when `name` holds
    /// [`PER_PEER`] already.
    pub fn identify(&mut self, name: &str) -> bool {
        let mut p = self.places.lock().expect("places");
        if p.peers.get(name).copied().unwrap_or(0) >= PER_PEER {
            return false;
        }
        *p.peers.entry(name.to_string()).or_default() += 1;
        if let Held::Pending(addr) = std::mem::replace(&mut self.held, Held::Peer(name.to_string())) {
            release_pending(&mut p, addr);
        }
        true
    }
}

fn release_pending(p: &mut Places, addr: std::net::IpAddr) {
    p.pending -= 1;
    if let Some(n) = p.by_address.get_mut(&addr) {
        *n -= 1;
        if *n == 0 {
            p.by_address.remove(&addr);
        }
    }
}

impl Drop for ConnectionPlace {
    fn drop(&mut self) {
        let mut p = self.places.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut self.held, Held::Released) {
            Held::Pending(addr) => release_pending(&mut p, addr),
            Held::Peer(name) => {
                if let Some(n) = p.peers.get_mut(&name) {
                    *n -= 1;
                    if *n == 0 {
                        p.peers.remove(&name);
                    }
                }
            }
            Held::Released => {}
        }
    }
}

/// "at its connection limit" warnings of the whole process: at most one a second, with a
/// count of those held back (a flood of connections must not flood the log).
static LIMITED: crate::lograte::LogRate = crate::lograte::LogRate::new(std::time::Duration::from_secs(1));

/// Accepts connections on the data port `port` names (`"data"`, `"writer"`) until `cancel`,
/// and returns how many it admitted. Each admitted by `limit` goes to `serve` with its place,
/// to be dropped when the connection ends; one beyond the limit is logged (rate-limited),
/// reported through `rejected` so the owner counts it, and closed. A failing accept
/// (typically EMFILE, out of descriptors) backs off 50 ms instead of spinning.
pub async fn accept_loop<Rejected>(
    listener: TcpListener,
    port: &'static str,
    limit: ConnectionLimit,
    cancel: tokio_util::sync::CancellationToken,
    mut serve: impl FnMut(tokio::net::TcpStream, SocketAddr, ConnectionPlace),
    mut rejected: impl FnMut() -> Rejected,
) -> u64
where
    Rejected: std::future::Future<Output = ()>,
{
    let mut admitted = 0u64;
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => match limit.admit(peer.ip()) {
                    Some(place) => {
                        admitted += 1;
                        serve(stream, peer, place);
                    }
                    None => {
                        if let Some(held_back) = LIMITED.check() {
                            tracing::warn!(%peer, port, limit = limit.limit(), held_back, "port at its connection limit: closed");
                        }
                        // Counted before it is closed: a peer that sees it closed knows.
                        rejected().await;
                        drop(stream);
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, port, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            _ = cancel.cancelled() => return admitted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's figures: 24 GiB, pressure at 383,868 pages, 128-kB default buffers.
    const HOST: KernelShare = KernelShare { pressure_bytes: 383_868 * 4096, default_receive: 131_072 };

    #[test]
    fn a_flood_from_one_address_leaves_room_and_a_process_keeps_its_own_place() {
        let a: std::net::IpAddr = "192.0.2.66".parse().unwrap();
        let b: std::net::IpAddr = "192.0.2.7".parse().unwrap();
        let limit = ConnectionLimit::identifying(3);
        let flood: Vec<_> = std::iter::from_fn(|| limit.admit(a)).take(1000).collect();
        assert_eq!(flood.len(), PER_ADDRESS, "one address holds a bounded part");
        // A source reconnecting meanwhile: room for its handshake, then a place of its own
        // that no pending connection takes.
        let mut source = limit.admit(b).expect("room beside the flood");
        assert!(source.identify("source0"));
        let others: Vec<_> = (0..300u32)
            .filter_map(|i| limit.admit(std::net::IpAddr::from([198, 51, (i >> 8) as u8, i as u8])))
            .collect();
        assert_eq!(flood.len() + others.len(), limit.limit(), "pending places up to the limit");
        assert!(limit.admit(b).is_none(), "full of pending connections");
        drop(others);
        let mut again = limit.admit(b).unwrap();
        assert!(again.identify("source0"), "a reconnection overlapping its old connection");
        let extra: Vec<_> = (0..PER_PEER).map(|_| limit.admit(b).unwrap()).collect();
        let identified: Vec<_> = extra.into_iter().filter_map(|mut p| p.identify("source0").then_some(p)).collect();
        assert_eq!(identified.len(), PER_PEER - 2, "a process holds a bounded number of its own");
        // Without identities (`data = "off"`) one address may take every place.
        let open = ConnectionLimit::new(3);
        let all: Vec<_> = std::iter::from_fn(|| open.admit(a)).take(1000).collect();
        assert_eq!(all.len(), open.limit());
        drop((flood, source, again, identified));
    }

    #[test]
    fn only_many_held_connections_get_a_smaller_receive_buffer() {
        assert_eq!(HOST.receive_buffer(10), None, "the default fits: autotuning stays on");
        assert_eq!(HOST.receive_buffer(5_000), None, "5,000 x 128 kB is within half the pool");
        // 10,000 connections: half of 1.57 GB shared, halved for the kernel's doubling.
        assert_eq!(HOST.receive_buffer(10_000), Some(39_308));
        assert_eq!(HOST.receive_buffer(10_000_000), Some(MIN_HELD_RECEIVE_BUFFER));
        assert_eq!(HOST.receive_buffer(0), None, "no connection expected is one");
    }

    #[test]
    fn this_host_s_figures_are_read() {
        let share = KernelShare::of_this_host().expect("Linux exposes tcp_mem and tcp_rmem");
        assert!(share.pressure_bytes > 0 && share.default_receive > 0);
    }

    #[tokio::test]
    async fn a_data_port_binds_udp_on_the_listener_s_port() {
        let port = bind_data_port("127.0.0.1:0".parse().unwrap(), Some(1 << 20)).unwrap();
        let udp = port.udp.as_ref().expect("asked for");
        assert_eq!(udp.local_addr().unwrap(), port.local_addr().unwrap());
        let tcp_only = bind_data_port("127.0.0.1:0".parse().unwrap(), None).unwrap();
        assert!(tcp_only.udp.is_none());
    }

    #[tokio::test]
    async fn a_taken_udp_number_makes_an_ephemeral_port_try_again() {
        let mut tried = Vec::new();
        let (tcp, udp) = bind_pair("127.0.0.1:0".parse().unwrap(), true, |at| {
            tried.push(at);
            if tried.len() < 3 { Err(std::io::ErrorKind::AddrInUse.into()) } else { Ok(at) }
        })
        .unwrap();
        assert_eq!(tried.len(), 3);
        assert_eq!(udp, Some(tcp.local_addr().unwrap()), "the pair shares the last listener's port");
        // Never free: it gives up after PAIR_ATTEMPTS with the reason.
        let mut n = 0;
        let e = bind_pair("127.0.0.1:0".parse().unwrap(), true, |_| -> std::io::Result<()> {
            n += 1;
            Err(std::io::ErrorKind::AddrInUse.into())
        })
        .unwrap_err();
        assert_eq!(n, PAIR_ATTEMPTS);
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains("binding UDP"), "{e}");
    }

    #[tokio::test]
    async fn a_fixed_port_whose_udp_number_is_taken_is_an_error_at_once() {
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = taken.local_addr().unwrap();
        // The TCP number may be taken too (then bind fails first); either way an error.
        let e = bind_data_port(at, Some(1 << 20)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    }

    #[tokio::test]
    async fn accepted_connections_inherit_the_listener_s_buffer() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let set = HOST.receive_buffer(10_000).expect("smaller than the default");
        set_receive_buffer(&listener, set).unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (accepted, _) = accepted.unwrap();
        drop(client);
        let got = socket2::SockRef::from(&accepted).recv_buffer_size().unwrap();
        assert_eq!(got, 2 * set, "the kernel doubles what is asked");
    }
}
