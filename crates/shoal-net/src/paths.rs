//! What a process's outgoing data links see of the network: connections that failed,
//! TCP segments the kernel sent again, datagrams sent again on a NACK, and links stalled
//! in retransmission timeouts right now. Run control's `network_path` rule reads them
//! from the statistics (`shoal_core::diagnosis::rules::network_path`).
//!
//! TCP's own counters come from the kernel (`TCP_INFO`): each link registers its socket
//! while connected ([`NetPaths::register`], a guard that unregisters when dropped, before
//! the socket closes), and a sample ([`NetPaths::sample`], once per statistics interval)
//! reads every registered socket plus what closed ones had counted. Reading from the
//! statistics task rather than after each write also sees a link whose write is blocked
//! on a path that stopped carrying anything, which is the stall worth seeing. The
//! registry keeps descriptor numbers, not duplicates: an embedded run near the process's
//! open-file limit (`shoal demo` at full shape) has no descriptor to spare per link.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One TCP connection's counters, as the kernel keeps them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpSample {
    /// Data segments sent since the connection opened.
    pub segments_out: u64,
    /// Of those, sent again because the path lost them (timeouts, fast retransmits, tail
    /// loss probes), less those the peer reported as duplicates (D-SACK): on loopback a
    /// busy host's tail loss probes fire about once per hundred segments and are all
    /// duplicates, which says nothing of the path.
    pub retransmitted: u64,
    /// In retransmission timeouts now: consecutive timeouts without an acknowledgement
    /// (zero-window probes do not count).
    pub stalled: bool,
}

/// The kernel's `TCP_INFO` for the socket `fd` (none: not a TCP socket, or not open).
#[allow(unsafe_code)]
pub fn tcp_sample(fd: &impl AsRawFd) -> Option<TcpSample> {
    raw_tcp_sample(fd.as_raw_fd())
}

#[allow(unsafe_code)]
fn raw_tcp_sample(fd: RawFd) -> Option<TcpSample> {
    // SAFETY: tcp_info is a plain C struct of integers, valid when zeroed; getsockopt
    // writes at most `len` bytes into it, and on a descriptor that is not open it fails
    // with EBADF (it reads nothing else of the process's memory).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    if rc != 0 {
        return None;
    }
    Some(TcpSample {
        segments_out: u64::from(info.tcpi_data_segs_out),
        retransmitted: u64::from(info.tcpi_total_retrans).saturating_sub(u64::from(info.tcpi_dsack_dups)),
        // Retransmission timeouts without an acknowledgement: nothing comes back from the
        // peer's host. Not the back-off of zero-window probes, which a peer process that
        // stopped reading causes while its host still answers (a hung builder, not the
        // path).
        stalled: info.tcpi_retransmits > 0,
    })
}

/// Totals over a process's data links (counters since the process started; `stalled` is
/// the links stalled now).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PathTotals {
    pub link_failures: u64,
    pub tcp_segments_out: u64,
    pub tcp_retransmitted: u64,
    pub tcp_links_stalled: u64,
    pub udp_datagrams: u64,
    pub udp_retransmitted: u64,
}

/// A process's data links' view of the network. See the module documentation.
#[derive(Debug, Default)]
pub struct NetPaths {
    /// Connections lost while writing, or refused after having been up.
    link_failures: AtomicU64,
    udp_datagrams: AtomicU64,
    udp_retransmitted: AtomicU64,
    tcp: Mutex<TcpRegistry>,
}

#[derive(Debug, Default)]
struct TcpRegistry {
    next: u64,
    /// Registered sockets: open while listed (their guards unregister them first).
    open: BTreeMap<u64, RawFd>,
    /// What connections closed since the start had counted.
    closed_segments_out: u64,
    closed_retransmitted: u64,
}

/// A link's registration, held beside its socket and dropped before it: what the
/// connection counted stays in the totals.
#[derive(Debug)]
pub struct Registered {
    paths: Arc<NetPaths>,
    key: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.paths.unregister(self.key);
    }
}

impl NetPaths {
    pub fn count_link_failure(&self) {
        self.link_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_datagrams_sent(&self, n: u64) {
        self.udp_datagrams.fetch_add(n, Ordering::Relaxed);
    }

    /// Datagrams sent again on a NACK (they are counted sent when they go).
    pub fn count_datagrams_resent(&self, n: u64) {
        self.udp_retransmitted.fetch_add(n, Ordering::Relaxed);
    }

    /// Follows a connected TCP socket until the guard is dropped. The guard must be
    /// dropped before the socket closes (keep both in one struct, the guard first: fields
    /// drop in order), so that a descriptor number is never read after it was reused.
    pub fn register(self: &Arc<Self>, socket: &impl AsRawFd) -> Registered {
        let mut r = self.tcp.lock().unwrap_or_else(|e| e.into_inner());
        r.next += 1;
        let key = r.next;
        r.open.insert(key, socket.as_raw_fd());
        Registered { paths: self.clone(), key }
    }

    /// The connection is closing: what it counted stays in the totals.
    fn unregister(&self, key: u64) {
        let mut r = self.tcp.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fd) = r.open.remove(&key)
            && let Some(s) = raw_tcp_sample(fd)
        {
            r.closed_segments_out += s.segments_out;
            r.closed_retransmitted += s.retransmitted;
        }
    }

    /// The totals now (reads every open TCP connection's counters).
    pub fn sample(&self) -> PathTotals {
        let r = self.tcp.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = PathTotals {
            link_failures: self.link_failures.load(Ordering::Relaxed),
            tcp_segments_out: r.closed_segments_out,
            tcp_retransmitted: r.closed_retransmitted,
            tcp_links_stalled: 0,
            udp_datagrams: self.udp_datagrams.load(Ordering::Relaxed),
            udp_retransmitted: self.udp_retransmitted.load(Ordering::Relaxed),
        };
        for &fd in r.open.values() {
            if let Some(s) = raw_tcp_sample(fd) {
                t.tcp_segments_out += s.segments_out;
                t.tcp_retransmitted += s.retransmitted;
                t.tcp_links_stalled += u64::from(s.stalled);
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_connected_socket_counts_its_segments_and_keeps_them_after_it_closes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 100_000];
            server.read_exact(&mut got).map(|()| got)
        });
        let paths = Arc::new(NetPaths::default());
        let reg = paths.register(&client);
        client.write_all(&[7u8; 100_000]).unwrap();
        assert!(reader.join().unwrap().unwrap().iter().all(|&b| b == 7));
        let open = paths.sample();
        assert!(open.tcp_segments_out > 0, "{open:?}");
        drop(reg);
        drop(client);
        let closed = paths.sample();
        assert!(closed.tcp_segments_out >= open.tcp_segments_out, "{closed:?} after {open:?}");
        paths.count_link_failure();
        paths.count_datagrams_sent(10);
        paths.count_datagrams_resent(2);
        let t = paths.sample();
        assert_eq!((t.link_failures, t.udp_datagrams, t.udp_retransmitted), (1, 10, 2));
    }

    #[test]
    fn a_socket_that_is_not_tcp_gives_no_sample() {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(tcp_sample(&udp), None);
    }
}
