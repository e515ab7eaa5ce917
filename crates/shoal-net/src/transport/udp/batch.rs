//! Batched datagram I/O through quinn-udp: a run of equal-sized datagrams to one address
//! leaves in one system call (UDP GSO: the kernel cuts one buffer into segments), and one
//! receive call takes up to [`quinn_udp::BATCH_SIZE`] buffers (recvmmsg), each of which
//! may hold many datagrams from one sender (UDP GRO). Where the kernel offers neither,
//! quinn-udp falls back to one datagram per call; nothing here depends on which.
//!
//! A frame cut by the core's sender is a run of pieces of exactly `max_payload` bytes and
//! a shorter last one: the shape GSO takes (equal segments, the last may be shorter), so a
//! 64 kB fragment leaves in two calls instead of 47.

use std::io::{self, IoSliceMut};
use std::net::SocketAddr;

use bytes::Bytes;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

use super::mac::SEAL_LEN;
use tokio::io::Interest;
use tokio::net::UdpSocket;

/// Largest UDP payload a GSO buffer may hold in total (the IP length field).
const GSO_MAX_BYTES: usize = 65_000;

/// A UDP socket with batched send and receive.
#[derive(Debug)]
pub struct BatchSocket {
    sock: UdpSocket,
    state: UdpSocketState,
    /// [`quinn_udp::BATCH_SIZE`] receive slots of `slot` bytes, allocated at the first
    /// receive (a source's sockets only send: 30,000 of them must not hold 3 MB each).
    recv_buf: Vec<u8>,
    slot: usize,
    /// `[security] data`: every datagram sent is sealed, every one received opened
    /// ([`super::mac`]).
    mac: Option<std::sync::Arc<super::mac::DatagramMac>>,
    /// Datagrams received whose tag did not verify (dropped).
    pub mac_refused: u64,
    /// The datagrams of one receive slot that [`BatchSocket::split`] keeps, kept between
    /// calls so the receive path allocates nothing for them.
    kept: Vec<(SocketAddr, std::ops::Range<usize>)>,
}

/// What one [`BatchSocket::send_all`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendOutcome {
    pub datagrams: u64,
    /// System calls made (fewer than datagrams when GSO batches).
    pub calls: u64,
    /// Datagrams the kernel refused (lost; the NACK protocol recovers them).
    pub refused: u64,
}

impl BatchSocket {
    /// Wraps `sock`; `max_datagram` is the largest datagram the protocol sends (receive
    /// slots are sized for a GRO batch of them, at least 64 kB).
    pub fn new(sock: UdpSocket, max_datagram: usize) -> io::Result<BatchSocket> {
        let state = UdpSocketState::new((&sock).into())?;
        let slot = (max_datagram * state.gro_segments()).clamp(65_536, 1 << 20);
        Ok(BatchSocket { sock, state, recv_buf: Vec::new(), slot, mac: None, mac_refused: 0, kept: Vec::new() })
    }

    /// Seals what it sends and opens what it receives under `mac` (none: plain).
    pub fn with_mac(mut self, mac: Option<std::sync::Arc<super::mac::DatagramMac>>) -> Self {
        self.mac = mac;
        self
    }

    /// One datagram to `dest`, sealed where a MAC is set.
    pub async fn send_one(&self, dest: SocketAddr, datagram: &[u8]) -> io::Result<usize> {
        match &self.mac {
            Some(mac) => self.sock.send_to(&mac.seal(datagram), dest).await,
            None => self.sock.send_to(datagram, dest).await,
        }
    }

    /// A datagram received outside the batches (`recv_from` on [`BatchSocket::socket`]):
    /// its contents, or `None` (counted) when its tag does not verify.
    pub fn open_one(&mut self, datagram: &[u8]) -> Option<Bytes> {
        let Some(mac) = &self.mac else { return Some(Bytes::copy_from_slice(datagram)) };
        let opened = mac.open(datagram);
        self.mac_refused += u64::from(opened.is_none());
        opened
    }

    pub fn socket(&self) -> &UdpSocket {
        &self.sock
    }

    /// Whether sends are batched (the kernel accepted UDP GSO).
    pub fn max_gso_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    /// Sends `datagrams` to `dest` in order, batching runs of equal size (plus one shorter
    /// tail) into one call each. Waits while the socket buffer is full; an error other than
    /// that counts the call's datagrams refused and goes on. Sealed datagrams are sealed
    /// into the call's buffer, the one copy either way.
    pub async fn send_all(&mut self, dest: SocketAddr, datagrams: &[Bytes]) -> SendOutcome {
        let mut out = SendOutcome::default();
        let extra = if self.mac.is_some() { SEAL_LEN } else { 0 };
        let mut i = 0;
        while i < datagrams.len() {
            let n = gso_run(&datagrams[i..], self.state.max_gso_segments(), extra);
            let segment = datagrams[i].len() + extra;
            // A GSO buffer: the run's datagrams back to back. Allocated per call, not kept:
            // a source process has a socket per builder (30,000 at full shape), and 64 kB
            // kept in each would be 2 GB.
            let gso_buf: Vec<u8>;
            let contents: &[u8] = match &self.mac {
                None if n == 1 => &datagrams[i],
                None => {
                    gso_buf = datagrams[i..i + n].concat();
                    &gso_buf
                }
                Some(mac) => {
                    let mut buf = Vec::with_capacity(n * segment);
                    for d in &datagrams[i..i + n] {
                        mac.seal_into(d, &mut buf);
                    }
                    gso_buf = buf;
                    &gso_buf
                }
            };
            let transmit = Transmit {
                destination: dest,
                ecn: None,
                contents,
                segment_size: (n > 1).then_some(segment),
                src_ip: None,
            };
            let (sock, state) = (&self.sock, &self.state);
            let r = sock.async_io(Interest::WRITABLE, || state.try_send(sock.into(), &transmit)).await;
            out.calls += 1;
            out.datagrams += n as u64;
            if r.is_err() {
                out.refused += n as u64;
            }
            i += n;
        }
        out
    }

    /// Waits for datagrams and appends each, with its sender, to `out` (one copy per
    /// receive slot; each datagram a slice of it). Returns how many were appended.
    pub async fn recv(&mut self, out: &mut Vec<(SocketAddr, Bytes)>) -> io::Result<usize> {
        let mut meta = [RecvMeta::default(); quinn_udp::BATCH_SIZE];
        let n = {
            let mut bufs = receive_slots(&mut self.recv_buf, self.slot);
            let (sock, state) = (&self.sock, &self.state);
            sock.async_io(Interest::READABLE, || state.recv(sock.into(), &mut bufs, &mut meta)).await?
        };
        Ok(self.split(&meta[..n], out))
    }

    /// As [`BatchSocket::recv`], but only what is waiting now: 0 when nothing is.
    pub fn try_recv(&mut self, out: &mut Vec<(SocketAddr, Bytes)>) -> io::Result<usize> {
        let mut meta = [RecvMeta::default(); quinn_udp::BATCH_SIZE];
        let n = {
            let mut bufs = receive_slots(&mut self.recv_buf, self.slot);
            let (sock, state) = (&self.sock, &self.state);
            // Straight to the (non-blocking) socket: tokio's `try_io` would not even try
            // before its reactor has seen the socket readable. A WouldBlock here leaves
            // tokio's readiness as it was; the next `recv` clears it when it finds nothing.
            match state.recv(sock.into(), &mut bufs, &mut meta) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) => return Err(e),
            }
        };
        Ok(self.split(&meta[..n], out))
    }

    /// Appends the datagrams of the filled slots to `out` (one copy per slot; each
    /// datagram a slice of it), opening each in place first where a seal is set and
    /// dropping (counting) those whose tag does not verify. Returns how many were appended.
    fn split(&mut self, meta: &[RecvMeta], out: &mut Vec<(SocketAddr, Bytes)>) -> usize {
        let slot = self.slot;
        let before = out.len();
        let mut kept = std::mem::take(&mut self.kept);
        for (i, m) in meta.iter().enumerate() {
            let len = m.len.min(slot);
            let buf = &mut self.recv_buf[i * slot..i * slot + len];
            let stride = if m.stride == 0 { len.max(1) } else { m.stride };
            let mut at = 0;
            while at < len {
                let end = (at + stride).min(len);
                match &self.mac {
                    None => kept.push((m.addr, at..end)),
                    Some(mac) => match mac.open_in_place(&mut buf[at..end]) {
                        Some(r) => kept.push((m.addr, at + r.start..at + r.end)),
                        None => self.mac_refused += 1,
                    },
                }
                at = end;
            }
            if !kept.is_empty() {
                let chunk = Bytes::copy_from_slice(&buf[..kept.last().map_or(0, |k| k.1.end)]);
                out.extend(kept.drain(..).map(|(addr, r)| (addr, chunk.slice(r))));
            }
        }
        self.kept = kept;
        out.len() - before
    }
}

/// The receive slots of `buf`, allocated at the first receive.
fn receive_slots(buf: &mut Vec<u8>, slot: usize) -> Vec<IoSliceMut<'_>> {
    if buf.is_empty() {
        *buf = vec![0; slot * quinn_udp::BATCH_SIZE];
    }
    buf.chunks_mut(slot).map(IoSliceMut::new).collect()
}

/// How many datagrams from the start of `ds` one GSO call can carry: a run of the first
/// one's size, optionally ended by one shorter datagram, at most `max_segments` and
/// [`GSO_MAX_BYTES`] in all, each `extra` bytes longer on the wire (a seal).
fn gso_run(ds: &[Bytes], max_segments: usize, extra: usize) -> usize {
    let segment = ds[0].len();
    if segment == 0 {
        return 1;
    }
    let limit = max_segments.min(GSO_MAX_BYTES / (segment + extra)).max(1).min(ds.len());
    let mut n = 1;
    while n < limit && ds[n].len() == segment {
        n += 1;
    }
    if n < limit && ds[n].len() < segment && !ds[n].is_empty() {
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(ls: &[usize]) -> Vec<Bytes> {
        ls.iter().map(|&l| Bytes::from(vec![0u8; l])).collect()
    }

    #[test]
    fn a_run_takes_equal_segments_and_one_shorter_tail() {
        assert_eq!(gso_run(&sizes(&[1472, 1472, 1472, 300, 1472]), 64, 0), 4);
        assert_eq!(gso_run(&sizes(&[1472, 1472, 1500]), 64, 0), 2);
        assert_eq!(gso_run(&sizes(&[300, 1472]), 64, 0), 1);
        assert_eq!(gso_run(&sizes(&[1472; 10]), 4, 0), 4);
        assert_eq!(gso_run(&sizes(&[1472; 100]), 64, 0), GSO_MAX_BYTES / 1472);
        assert_eq!(gso_run(&sizes(&[40_000, 40_000]), 64, 0), 1);
        assert_eq!(gso_run(&sizes(&[1472]), 1, 0), 1);
        // Sealed, each is longer on the wire: fewer fit in one call.
        assert_eq!(gso_run(&sizes(&[1472; 100]), 64, SEAL_LEN), GSO_MAX_BYTES / (1472 + SEAL_LEN));
    }

    /// Whatever the kernel batches, the receiver gets every datagram, in order, intact.
    #[tokio::test]
    async fn batched_datagrams_arrive_whole_and_in_order() {
        send_and_receive_batches(None).await;
    }

    /// Sealed, the same; and a datagram without the seal is dropped and counted.
    #[tokio::test]
    async fn sealed_batches_arrive_whole_and_strangers_are_counted() {
        let key = super::super::mac::DatagramMac::new_key_hex().unwrap();
        let rx = send_and_receive_batches(Some(&key)).await;
        assert_eq!(rx.mac_refused, 1);
    }

    async fn send_and_receive_batches(key: Option<&str>) -> BatchSocket {
        let mac = || key.map(|k| std::sync::Arc::new(super::super::mac::DatagramMac::from_hex(k).unwrap()));
        let rx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let to = rx.local_addr().unwrap();
        let mut rx = BatchSocket::new(rx, 1472 + SEAL_LEN).unwrap().with_mac(mac());
        let mut tx = BatchSocket::new(UdpSocket::bind("127.0.0.1:0").await.unwrap(), 1472).unwrap().with_mac(mac());
        let from = tx.socket().local_addr().unwrap();
        // A stranger's datagram first (refused where sealed; counted as one datagram here).
        let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        stranger.send_to(&[9; 100], to).unwrap();
        let mut got = Vec::new();
        while got.is_empty() && rx.mac_refused == 0 {
            rx.recv(&mut got).await.unwrap();
        }
        got.clear();
        // Three frames' pieces: 40 full ones and a tail, 1 short, 5 full.
        let mut ds = Vec::new();
        for (i, len) in std::iter::repeat_n(1472, 40).chain([700, 90]).chain(std::iter::repeat_n(1472, 5)).enumerate() {
            ds.push(Bytes::from((0..len).map(|b| (b + i) as u8).collect::<Vec<_>>()));
        }
        let sent = tx.send_all(to, &ds).await;
        assert_eq!((sent.datagrams, sent.refused), (ds.len() as u64, 0));
        // With GSO the 40 full pieces and their tail leave in one call (at most 44 fit in
        // 65,000 bytes, 43 sealed), the 90-byte one alone, the last five together.
        if tx.max_gso_segments() >= 64 {
            assert_eq!(sent.calls, 3);
        } else {
            assert!(sent.calls <= ds.len() as u64);
        }
        while got.len() < ds.len() {
            rx.recv(&mut got).await.unwrap();
        }
        assert_eq!(rx.try_recv(&mut got).unwrap(), 0, "nothing more waits");
        assert_eq!(got.len(), ds.len());
        for ((addr, d), want) in got.iter().zip(&ds) {
            assert_eq!(*addr, from);
            assert_eq!(d, want);
        }
        rx
    }

    /// What is already in the socket is taken without waiting, in order; an empty socket
    /// gives nothing at once. (Taking turns with `recv`, which waits when nothing has
    /// arrived yet, so the test does not depend on when loopback delivers.)
    #[tokio::test]
    async fn waiting_datagrams_are_taken_without_waiting() {
        let rx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let to = rx.local_addr().unwrap();
        let mut rx = BatchSocket::new(rx, 1472).unwrap();
        let mut got = Vec::new();
        assert_eq!(rx.try_recv(&mut got).unwrap(), 0, "an empty socket");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        // 30 x 1000 bytes: well within a default receive buffer.
        for i in 0..30u8 {
            tx.send_to(&[i; 1000], to).unwrap();
        }
        while got.len() < 30 {
            if rx.try_recv(&mut got).unwrap() == 0 {
                rx.recv(&mut got).await.unwrap();
            }
        }
        assert_eq!(got.len(), 30);
        assert!(got.iter().enumerate().all(|(i, (_, d))| d.len() == 1000 && d[0] == i as u8));
        assert_eq!(rx.try_recv(&mut got).unwrap(), 0, "nothing more waits");
    }
}
