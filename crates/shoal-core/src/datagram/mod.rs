//! The datagram transport (UDP) with selective retransmission, sans-IO.
//!
//! A fragment's frame (the same bytes TCP carries, [`crate::frame`]) is cut into datagrams
//! that fit the path MTU. Each (source, builder) pair is one stream with its own sequence
//! numbers; the builder's [`DatagramReceiver`] reassembles frames, detects loss from
//! sequence gaps (and, at the end of a stream, from the sender's final sequence number),
//! and asks for the missing datagrams with NACKs within a time budget. The source's
//! [`DatagramSender`] keeps a bounded retransmit buffer (bytes and age) to answer them.
//! [`BuilderEndpoint`] demultiplexes one builder's socket into per-source receivers and
//! counts every datagram it refuses (garbage, truncated, corrupted, another run, another
//! builder, an unknown source).
//!
//! Loss is never guessed: a datagram is declared lost only when a gap or the end-of-stream
//! sequence number shows it was sent, and every NACK for it went unanswered within the
//! budget. What cannot be completed is counted ([`ReceiverStats::fragments_damaged`]:
//! fragments partly received and given up), and the run's ledger derives the fragments of
//! which nothing arrived from the source's sent count (`lost_in_transport`).
//!
//! Wire format (docs/wire-format.md, "Datagrams"): a 52-byte little-endian header with a
//! CRC32C over header and payload, then the payload.

mod receiver;
mod sender;
mod wire;

pub use receiver::{BuilderEndpoint, DatagramReceiver, EndpointEvent, EndpointStats, ReceivedFragment, ReceiverStats};
pub use sender::{DatagramSender, SenderStats};
pub use wire::{
    DATAGRAM_HEADER_LEN, DATAGRAM_MAGIC, Datagram, DatagramError, DatagramHeader, Kind, MAX_NACK_SEQS, crc_of,
};

use crate::Duration;

/// The budgets of the datagram transport, shared by sender and receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpConfig {
    /// Largest datagram payload (bytes after the 52-byte header). The default, 1420, keeps a
    /// datagram within a 1500-byte Ethernet MTU with IPv4 or IPv6 and UDP headers, so the IP
    /// layer never fragments (one lost IP fragment would lose the whole datagram).
    pub max_payload: u16,
    /// Retransmit buffer of one stream: at most this many bytes ...
    pub retransmit_bytes: u64,
    /// ... and none older than this. A NACK for an older datagram is unanswerable (counted).
    pub retransmit_age: Duration,
    /// The datagrams of a stream's first `start_retransmit_age` are kept that long instead
    /// (still within `retransmit_bytes`). A path's first packets wait while the kernel
    /// resolves the neighbour (ARP). When that exchange is lost, Linux asks again only
    /// after a second and drops the oldest packets it holds, so the builder sees the
    /// stream's first gap a second late.
    pub start_retransmit_age: Duration,
    /// A gap is NACKed this long after it is seen: datagrams reordered by less are not
    /// asked for.
    pub nack_delay: Duration,
    /// An unanswered NACK is repeated after this long, then after twice as long each time
    /// ...
    pub nack_interval: Duration,
    /// ... at most this many times in all; then the datagram is declared lost.
    pub max_nacks: u32,
    /// A partly received fragment is given up (counted damaged) this long after its first
    /// datagram arrived.
    pub reassembly_timeout: Duration,
    /// A sender idle this long after its last data sends its next sequence number
    /// (`SYNC`), so that the loss of a stream's last datagrams is seen without waiting
    /// for the next slice.
    pub probe_delay: Duration,
    /// The end of a stream (`END`, carrying the final sequence number) is repeated this
    /// often until the builder acknowledges it ...
    pub end_interval: Duration,
    /// ... at most this many times.
    pub max_ends: u32,
    /// Most bytes of frames one stream may hold in reassembly at once, and most sequence
    /// numbers missing at once; beyond either, the oldest are given up (bounds a builder's
    /// memory whatever arrives). A frame longer than `reassembly_bytes` is refused.
    pub reassembly_bytes: u64,
    pub max_missing: u32,
}

impl Default for UdpConfig {
    /// Budgets for a data-centre network (RTT well under a millisecond) and 10 ms slices:
    /// NACK 1 ms after a gap, then 5, 10 and 20 ms after each NACK (4 NACKs: a loss is
    /// repaired a millisecond or two after its gap when the source answers at once; a source
    /// up to about 70 ms late, waiting for a CPU, is still heard, and a datagram is declared
    /// lost 76 ms after its gap, before the reassembly limit); a retransmit buffer of 64 MiB
    /// or 500 ms per stream (a datagram may wait in its host's queue and a stalled builder
    /// see the gap late: with 200 ms, testbed runs whose processes stalled for 100-300 ms
    /// had NACKs arrive too late to be answered, 4-22 datagrams per run; the byte limit
    /// binds first above 1 Gbit/s), and 2 s for the datagrams of the stream's first 2 s (a
    /// lost ARP exchange holds a path's first packets for a second: docs/testbed.md);
    /// reassembly given up after 100 ms, at most 64 MiB of it per source.
    fn default() -> Self {
        Self {
            max_payload: 1420,
            retransmit_bytes: 64 << 20,
            retransmit_age: Duration::from_millis(500),
            start_retransmit_age: Duration::from_secs(2),
            nack_delay: Duration::from_millis(1),
            nack_interval: Duration::from_millis(5),
            max_nacks: 4,
            reassembly_timeout: Duration::from_millis(100),
            probe_delay: Duration::from_millis(2),
            end_interval: Duration::from_millis(20),
            max_ends: 50,
            reassembly_bytes: 64 << 20,
            max_missing: 65_536,
        }
    }
}
