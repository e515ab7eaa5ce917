//! The consumer socket: abstract-namespace `SOCK_SEQPACKET`, 48-byte messages, the memfd
//! passed once with `SCM_RIGHTS`.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use shoal_core::slicering::msg::{self, Msg};

/// The abstract socket name of builder `builder` under `template` (`{builder}` replaced;
/// default template `shoal/b{builder}`). Abstract names vanish with the socket.
pub fn socket_name(template: &str, builder: u32) -> String {
    let t = if template.is_empty() { "shoal/b{builder}" } else { template };
    t.replace("{builder}", &builder.to_string())
}

pub(crate) fn addr(name: &str) -> io::Result<SocketAddrUnix> {
    Ok(SocketAddrUnix::new_abstract_name(name.as_bytes())?)
}

pub(crate) fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?)
}

/// A connected pair (a worker's socket, the acceptor's stop signal).
pub(crate) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?)
}

pub(crate) fn send(fd: BorrowedFd<'_>, m: &Msg, pass: Option<BorrowedFd<'_>>, block: bool) -> io::Result<()> {
    let bytes = m.encode();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = pass {
        fds = [fd];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let flags = if block { SendFlags::NOSIGNAL } else { SendFlags::NOSIGNAL | SendFlags::DONTWAIT };
    let n = rustix::net::sendmsg(fd, &[io::IoSlice::new(&bytes)], &mut control, flags)?;
    if n != msg::LEN {
        return Err(io::Error::other("short send on a seqpacket socket"));
    }
    Ok(())
}

/// What a receive got.
pub(crate) enum Recv {
    Msg(Msg, Option<OwnedFd>),
    /// Not a valid message (counted by the caller; the peer is closed).
    Bad(String),
    /// Nothing waiting (non-blocking receive).
    Empty,
    /// The peer closed.
    Closed,
}

pub(crate) fn recv(fd: BorrowedFd<'_>, block: bool) -> io::Result<Recv> {
    // One byte more than a message: a longer message shows as truncated.
    let mut buf = [0u8; msg::LEN + 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let flags = if block { RecvFlags::CMSG_CLOEXEC } else { RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT };
    let r = match rustix::net::recvmsg(fd, &mut [io::IoSliceMut::new(&mut buf)], &mut control, flags) {
        Ok(r) => r,
        Err(rustix::io::Errno::AGAIN) => return Ok(Recv::Empty),
        Err(rustix::io::Errno::CONNRESET) => return Ok(Recv::Closed),
        Err(e) => return Err(e.into()),
    };
    let mut passed = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                passed.get_or_insert(f);
            }
        }
    }
    if r.bytes == 0 {
        return Ok(Recv::Closed);
    }
    match Msg::decode(&buf[..r.bytes.min(buf.len())]) {
        Ok(m) => Ok(Recv::Msg(m, passed)),
        Err(e) => Ok(Recv::Bad(e.to_string())),
    }
}

/// Waits until one of `fds` is readable or `timeout` passes; returns the readable ones'
/// indices.
pub(crate) fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<usize>> {
    let mut pfds: Vec<PollFd<'_>> = fds.iter().map(|f| PollFd::new(f, PollFlags::IN)).collect();
    let ts = timeout.map(|d| Timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as i64 });
    match poll(&mut pfds, ts.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(pfds.iter().enumerate().filter(|(_, p)| !p.revents().is_empty()).map(|(i, _)| i).collect())
}
