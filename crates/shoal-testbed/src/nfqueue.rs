//! A minimal netfilter queue client (nfnetlink_queue) for the delay lines: bind one queue
//! in metadata-only mode, read the ids of queued packets, accept every packet up to an id
//! with one batch verdict.
//!
//! Written here rather than taken from the `nfq` crate: its release (0.2.5) neither
//! exposes its socket, so a delay line could not wait for packets and for its next due
//! time at once (poll), nor sends batch verdicts, which cut the system calls of a delay
//! line to one per release round instead of one per packet. The wire format is the
//! kernel's `include/uapi/linux/netfilter/nfnetlink_queue.h`: a netlink header, a
//! `nfgenmsg` whose `res_id` is the queue number (big-endian), then attributes.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType};

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQNL_MSG_VERDICT_BATCH: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
const NF_ACCEPT: u32 = 1;
/// Netlink header (16 bytes) and `nfgenmsg` (4 bytes).
const HEADER: usize = 20;

/// One bound netfilter queue.
#[derive(Debug)]
pub struct NfQueue {
    fd: OwnedFd,
    num: u16,
    seq: u32,
    buf: Vec<u8>,
    /// Ids that arrived while a configuration request waited for its answer.
    early: Vec<u32>,
}

impl NfQueue {
    /// Binds queue `num` of the current network namespace: metadata only (the packet's
    /// bytes stay in the kernel), at most `max_len` packets waiting, and a full queue drops
    /// rather than letting packets through undelayed.
    pub fn bind(num: u16, max_len: u32) -> io::Result<NfQueue> {
        let fd = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, Some(rustix::net::netlink::NETFILTER))?;
        rustix::net::bind(&fd, &rustix::net::netlink::SocketAddrNetlink::new(0, 0))?;
        let mut q = NfQueue { fd, num, seq: 0, buf: vec![0; 1 << 16], early: Vec::new() };
        q.configure(&[(NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, 0, 0])])?;
        let mut params = [0u8; 5];
        params[4] = NFQNL_COPY_META;
        q.configure(&[(NFQA_CFG_PARAMS, &params)])?;
        q.configure(&[(NFQA_CFG_QUEUE_MAXLEN, &max_len.to_be_bytes())])?;
        q.configure(&[(NFQA_CFG_FLAGS, &0u32.to_be_bytes()), (NFQA_CFG_MASK, &NFQA_CFG_F_FAIL_OPEN.to_be_bytes())])?;
        Ok(q)
    }

    /// Sends a configuration message and waits for the kernel's answer.
    fn configure(&mut self, attrs: &[(u16, &[u8])]) -> io::Result<()> {
        self.seq += 1;
        let msg = encode(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, self.seq, self.num, attrs);
        rustix::net::send(&self.fd, &msg, SendFlags::empty())?;
        loop {
            let n = self.receive(RecvFlags::empty())?;
            let mut answer = None;
            for m in messages(&self.buf[..n]) {
                match m {
                    Message::Packet(id) => self.early.push(id),
                    Message::Error(errno) => answer = Some(errno),
                    Message::Other => {}
                }
            }
            match answer {
                Some(0) => return Ok(()),
                Some(errno) => return Err(io::Error::from_raw_os_error(errno)),
                None => {}
            }
        }
    }

    fn receive(&mut self, flags: RecvFlags) -> io::Result<usize> {
        let (_, n) = rustix::net::recv(&self.fd, &mut self.buf[..], flags | RecvFlags::TRUNC)?;
        if n > self.buf.len() {
            return Err(io::Error::other(format!("a netlink message of {n} bytes (metadata only was asked for)")));
        }
        Ok(n)
    }

    /// Appends the ids of the packets waiting on the socket now (none if none); false
    /// once the socket has nothing more.
    pub fn receive_ids(&mut self, ids: &mut Vec<u32>) -> io::Result<bool> {
        ids.append(&mut self.early);
        let n = match self.receive(RecvFlags::DONTWAIT) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        };
        for m in messages(&self.buf[..n]) {
            match m {
                Message::Packet(id) => ids.push(id),
                Message::Error(0) | Message::Other => {}
                Message::Error(errno) => return Err(io::Error::from_raw_os_error(errno)),
            }
        }
        Ok(true)
    }

    /// Lets every packet up to and including `id` go on (the kernel's ids wrap, and it
    /// compares them modulo 2^32).
    pub fn accept_through(&mut self, id: u32) -> io::Result<()> {
        let mut hdr = [0u8; 8];
        hdr[..4].copy_from_slice(&NF_ACCEPT.to_be_bytes());
        hdr[4..].copy_from_slice(&id.to_be_bytes());
        self.seq += 1;
        let msg = encode(NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, self.seq, self.num, &[(NFQA_VERDICT_HDR, &hdr)]);
        rustix::net::send(&self.fd, &msg, SendFlags::empty())?;
        Ok(())
    }
}

impl AsFd for NfQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A netlink message to the queue subsystem.
fn encode(kind: u16, flags: u16, seq: u32, queue: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER + 64);
    m.extend_from_slice(&0u32.to_ne_bytes()); // length, below
    m.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    m.extend_from_slice(&[0, 0]); // AF_UNSPEC, NFNETLINK_V0
    m.extend_from_slice(&queue.to_be_bytes());
    for (kind, value) in attrs {
        m.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(value);
        m.resize(m.len().next_multiple_of(4), 0);
    }
    let len = m.len() as u32;
    m[..4].copy_from_slice(&len.to_ne_bytes());
    m
}

#[derive(Debug, PartialEq, Eq)]
enum Message {
    /// A queued packet's id.
    Packet(u32),
    /// An answer: 0 acknowledges, otherwise an errno.
    Error(i32),
    Other,
}

/// The messages of one datagram from the kernel; a malformed tail is ignored.
fn messages(mut data: &[u8]) -> impl Iterator<Item = Message> + '_ {
    std::iter::from_fn(move || {
        if data.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes(data[..4].try_into().expect("4 bytes")) as usize;
        if len < 16 || len > data.len() {
            data = &[];
            return None;
        }
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let body = &data[16..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(match kind {
            NLMSG_ERROR if body.len() >= 4 => Message::Error(-i32::from_ne_bytes(body[..4].try_into().expect("4"))),
            NLMSG_DONE => Message::Other,
            k if k == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET => {
                packet_id(body.get(4..).unwrap_or_default()).map_or(Message::Other, Message::Packet)
            }
            _ => Message::Other,
        })
    })
}

/// The id in a packet message's attributes (`NFQA_PACKET_HDR`: id, protocol, hook).
fn packet_id(mut attrs: &[u8]) -> Option<u32> {
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        // The top bits of the type are flags (nested, byte order).
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == NFQA_PACKET_HDR && len >= 8 {
            return Some(u32::from_be_bytes(attrs[4..8].try_into().expect("4 bytes")));
        }
        attrs = &attrs[len.next_multiple_of(4).min(attrs.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packet message as the kernel sends it: a timestamp-like attribute first, then the
    /// packet header.
    fn packet_message(id: u32) -> Vec<u8> {
        let mut hdr = id.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[0x08, 0x00, 2]);
        encode(NFQNL_MSG_PACKET, 0, 0, 0, &[(9, &[1, 2, 3, 4, 5, 6, 7, 8]), (NFQA_PACKET_HDR, &hdr)])
    }

    #[test]
    fn packet_ids_are_read_from_each_message_of_a_datagram() {
        let mut datagram = packet_message(7);
        datagram.extend(packet_message(0xfffffffe));
        assert_eq!(messages(&datagram).collect::<Vec<_>>(), vec![Message::Packet(7), Message::Packet(0xfffffffe)]);
    }

    #[test]
    fn answers_and_garbage_are_told_apart() {
        // nlmsghdr, then nlmsgerr: the error (-EPERM) and the header it answers.
        let answer = |error: i32| {
            let mut m = Vec::new();
            m.extend_from_slice(&36u32.to_ne_bytes());
            m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(&error.to_ne_bytes());
            m.extend_from_slice(&[0; 16]);
            m
        };
        let mut two = answer(-1);
        two.extend(answer(0));
        assert_eq!(messages(&two).collect::<Vec<_>>(), vec![Message::Error(1), Message::Error(0)]);
        // A length past the end, a truncated header, random bytes: no panic, nothing read.
        let mut bad = packet_message(3);
        bad[..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(messages(&bad).count(), 0);
        assert_eq!(messages(&[1, 2, 3]).count(), 0);
        assert_eq!(packet_id(&[0xff, 0xff, 1, 0, 9]), None);
    }

    #[test]
    fn a_batch_verdict_names_the_queue_and_the_last_id() {
        let m =
            encode(NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, 5, 0x0102, &[(NFQA_VERDICT_HDR, &[0, 0, 0, 1, 0, 0, 0, 9])]);
        assert_eq!(m.len(), HEADER + 12);
        assert_eq!(u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize, m.len());
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), (3 << 8) | 3);
        assert_eq!(&m[18..20], &[1, 2], "the queue number, big-endian");
        assert_eq!(&m[24..32], &[0, 0, 0, 1, 0, 0, 0, 9]);
    }
}
