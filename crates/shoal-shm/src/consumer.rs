//! The consumer's side: attach, read slices in place, release them.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant as StdInstant};

use memmap2::Mmap;
use shoal_core::slicering::layout::{self, Control, FragmentEntry};
use shoal_core::slicering::msg::Msg;

use crate::Policy;
use crate::sock::{self, Recv};

/// How a consumer wants to be treated when it is slow.
#[derive(Clone, Copy, Debug)]
pub struct ConsumerOptions {
    pub policy: Policy,
    /// Most slices held (read but not released) at once; more are skipped for it.
    pub window: u32,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self { policy: Policy::Skip, window: 4 }
    }
}

/// An attached consumer.
pub struct SliceConsumer {
    sock: Arc<OwnedFd>,
    map: Arc<Mmap>,
    pub run: u64,
    pub builder: u32,
    /// Slices taken back by the ring before this consumer read them.
    pub lost_before_read: u64,
}

/// What [`SliceConsumer::next`] got.
pub enum Next {
    Slice(SliceRef),
    /// The run ended: what this consumer was offered, skipped and overrun.
    End {
        offered: u64,
        skipped: u64,
        overrun: u64,
    },
    /// Nothing within the timeout.
    Timeout,
}

/// One slice in the shared ring, read in place. Valid until released (dropping it
/// releases it too).
pub struct SliceRef {
    map: Arc<Mmap>,
    sock: Option<Arc<OwnedFd>>,
    pub seq: u64,
    pub slice: u64,
    pub slice_start_ns: u64,
    pub slice_ns: u64,
    start: usize,
    len: usize,
    fragments: Vec<FragmentEntry>,
}

/// One fragment of a [`SliceRef`].
#[derive(Clone, Copy, Debug)]
pub struct FragmentRef<'a> {
    pub source: u32,
    pub flags: u16,
    pub hit_count: u32,
    pub payload: &'a [u8],
}

impl SliceConsumer {
    /// Attaches to the builder listening at abstract socket `name`.
    pub fn connect(name: &str, opts: ConsumerOptions) -> io::Result<Self> {
        let fd = sock::seqpacket()?;
        rustix::net::connect(&fd, &sock::addr(name)?)?;
        let (policy, hold_ms) = match opts.policy {
            Policy::Hold { max } => (0, max.as_millis() as u64),
            Policy::Skip => (1, 0),
        };
        sock::send(fd.as_fd(), &Msg::Hello { policy, hold_ms, window: opts.window.max(1) as u64 }, None, true)?;
        let (run, builder, map_len, memfd) = match sock::recv(fd.as_fd(), true)? {
            Recv::Msg(Msg::Welcome { run, builder, map_len }, Some(memfd)) => (run, builder, map_len, memfd),
            Recv::Closed => return Err(io::Error::new(io::ErrorKind::ConnectionRefused, "the builder refused")),
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "no welcome with the ring from the builder")),
        };
        let file = std::fs::File::from(memfd);
        if file.metadata()?.len() < map_len {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the ring is shorter than announced"));
        }
        // SAFETY: read-only shared mapping of the builder's memfd, which is never truncated;
        // bytes may change under us only where the ring reclaimed space, which
        // `SliceRef::release` detects.
        let map = unsafe { memmap2::MmapOptions::new().len(map_len as usize).map(&file)? };
        Control::decode(&map[..]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        Ok(Self { sock: Arc::new(fd), map: Arc::new(map), run, builder: builder as u32, lost_before_read: 0 })
    }

    /// [`Self::connect`], retried every 20 ms until `within` passes (a builder starting).
    pub fn connect_within(name: &str, opts: ConsumerOptions, within: Duration) -> io::Result<Self> {
        let t = StdInstant::now();
        loop {
            match Self::connect(name, opts) {
                Ok(c) => return Ok(c),
                Err(e) if t.elapsed() >= within => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The next slice, the end of the run, or a timeout (`None`: wait as long as it takes).
    /// A closed socket (the builder gone) is an `UnexpectedEof` error.
    pub fn next(&mut self, timeout: Option<Duration>) -> io::Result<Next> {
        if timeout.is_some() && sock::wait_readable(&[self.sock.as_fd()], timeout)?.is_empty() {
            return Ok(Next::Timeout);
        }
        match sock::recv(self.sock.as_fd(), true)? {
            Recv::Msg(Msg::Slice { seq, offset, len, slice }, _) => {
                let (start, len) = (offset as usize, len as usize);
                if reclaimed_below(&self.map) > seq {
                    // Taken back before we got to it (the builder counted an overrun): the
                    // release keeps its books straight; the next message may be usable.
                    let _ = sock::send(self.sock.as_fd(), &Msg::Release { seq }, None, true);
                    self.lost_before_read += 1;
                    return self.next(timeout);
                }
                if start.checked_add(len).is_none_or(|end| end > self.map.len()) {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "slice outside the ring"));
                }
                let (head, fragments) = layout::read_slot(&self.map[start..start + len])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                if head.seq != seq {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "slot sequence mismatch"));
                }
                Ok(Next::Slice(SliceRef {
                    map: self.map.clone(),
                    sock: Some(self.sock.clone()),
                    seq,
                    slice,
                    slice_start_ns: head.slice_start_ns,
                    slice_ns: head.slice_ns,
                    start,
                    len,
                    fragments,
                }))
            }
            Recv::Msg(Msg::End { offered, skipped, overrun }, _) => Ok(Next::End { offered, skipped, overrun }),
            Recv::Closed => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the builder closed the slice socket")),
            Recv::Msg(m, _) => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected {m:?}"))),
            Recv::Bad(why) => Err(io::Error::new(io::ErrorKind::InvalidData, why)),
            Recv::Empty => Ok(Next::Timeout),
        }
    }
}

impl SliceRef {
    pub fn fragment_count(&self) -> usize {
        self.fragments.len()
    }

    /// Fragment `i`, its payload a view into the ring.
    pub fn fragment(&self, i: usize) -> FragmentRef<'_> {
        let f = &self.fragments[i];
        let at = self.start + f.offset as usize;
        FragmentRef {
            source: f.source,
            flags: f.flags,
            hit_count: f.hit_count,
            payload: &self.map[at..at + f.len as usize],
        }
    }

    pub fn fragments(&self) -> impl Iterator<Item = FragmentRef<'_>> {
        (0..self.fragments.len()).map(|i| self.fragment(i))
    }

    /// The whole slot (header, table, payloads).
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// True while no byte of this slot has been reused: checked after reading, a true
    /// answer means everything read so far was the builder's data.
    pub fn intact(&self) -> bool {
        reclaimed_below(&self.map) <= self.seq
    }

    /// Done with the slice. Returns whether it stayed intact until now (false: the ring took
    /// it back first, counted as an overrun by the builder).
    pub fn release(mut self) -> bool {
        self.send_release()
    }

    fn send_release(&mut self) -> bool {
        let intact = self.intact();
        if let Some(s) = self.sock.take() {
            // A builder gone is not this consumer's error.
            let _ = sock::send(s.as_fd(), &Msg::Release { seq: self.seq }, None, true);
        }
        intact
    }
}

impl Drop for SliceRef {
    fn drop(&mut self) {
        self.send_release();
    }
}

/// The ring's `reclaimed_below`, read with acquire ordering (after the reads it vouches for).
fn reclaimed_below(map: &Mmap) -> u64 {
    let p = map[layout::RECLAIMED_BELOW_AT..].as_ptr() as *mut u64;
    // SAFETY: 8-aligned word in the control page, written atomically by the builder; only
    // loaded here.
    let a = unsafe { AtomicU64::from_ptr(p) };
    a.load(Ordering::Acquire)
}
