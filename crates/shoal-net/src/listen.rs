//! Listening sockets for data ports with a deep accept queue.
//!
//! tokio's `TcpListener::bind` asks for a backlog of 1,024. A run whose sources all
//! connect at once (thousands of source nodes) overflows it; Linux then drops the
//! handshake's last ACK while the client already counts the connection as open, writes its
//! data into its own socket buffer and closes, and the data never reaches the builder.
//! Data ports ask for the kernel's most (`net.core.somaxconn`, 4,096 by default).

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

/// How long a new data connection has to deliver its first whole frame before it is closed
/// (`no_frame_in_time`): a connection that says nothing holds a descriptor for nothing.
/// Sources send a hello or a fragment within a slice or two of connecting (slices are at
/// most 4 s).
pub const FIRST_FRAME_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Most connections a data port keeps open at once. Beyond, a new connection is closed at
/// once and counted (`connection_limit`), so a flood cannot take the process's descriptors
/// from its data path; connections that never send a frame leave within
/// [`FIRST_FRAME_WITHIN`], making room again.
#[derive(Clone, Debug)]
pub struct ConnectionLimit {
    places: std::sync::Arc<tokio::sync::Semaphore>,
    limit: usize,
}

impl ConnectionLimit {
    /// A port expecting up to `expected` legitimate connections: room for them and 256
    /// more (reconnections whose old connection is not yet seen closed, monitoring).
    pub fn new(expected: usize) -> Self {
        let limit = expected + 256;
        Self { places: std::sync::Arc::new(tokio::sync::Semaphore::new(limit)), limit }
    }

    /// A place for a new connection (given back when dropped), or `None` at the limit.
    pub fn admit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.places.clone().try_acquire_owned().ok()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}
