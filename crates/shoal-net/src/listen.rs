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
