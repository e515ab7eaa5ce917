//! The transport below the roles: how bytes move, not what they mean.
//!
//! - [`link`]: one outgoing TCP connection with reconnect and backoff ([`link::Link`]),
//!   used by sources (to each builder) and builders (to the writer);
//! - [`listen`]: bound ports, the accept loop with its connection limit and kernel-memory
//!   share;
//! - [`chunk`]: the pieces of frames a link writes ([`chunk::Chunk`]);
//! - [`framed`]: frames read from a byte stream ([`framed::FrameReader`]);
//! - [`write_queue`]: control frames queued to one connection's write half;
//! - [`udp`]: the datagram transport (selective retransmission, batched system calls);
//! - [`uring`]: a builder's connections read through io_uring;
//! - [`ucx`]: the `ucx` transport (frames as UCX active messages beside the TCP
//!   connection that sets them up);
//! - [`secure`]: the bulk path's handshakes (`[security] data`) and the certificates each
//!   role presents;
//! - [`timer`]: the microsecond timer sources wait on ([`timer::FineTimer`]).
//!
//! Nothing here knows a role: the roles (`crate::source`, `crate::builder`,
//! `crate::writer`, `crate::dfm`) compose these pieces.

pub mod chunk;
pub mod framed;
pub mod link;
pub mod listen;
pub mod secure;
pub mod timer;
pub mod ucx;
pub mod udp;
pub mod uring;
pub mod write_queue;
