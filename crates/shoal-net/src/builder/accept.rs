//! The data port: accepting source connections, reading each (a task of its own, or the
//! io_uring thread), checking every frame, and handing what one read brought to the
//! builder's loop in one message.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use shoal_core::frame::{Flags, Frame};
use shoal_core::hit::HitPayload;
use shoal_core::pullmsg::PullMessage;
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_core::{Instant, SourceId};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::builder::hold::{ConnectionGate, ReadGate, WindowEdge};
use crate::clock::WallClock;
use crate::transport::framed::{FrameReader, Frames, ReadEnd};
use crate::transport::secure::{DataPort, Speaker};
use crate::transport::ucx::{UcxFrames, UcxReceiver};
use crate::transport::write_queue::write_queued_until;

pub(super) enum Incoming {
    Frame {
        frame: Frame,
        arrival: Instant,
        /// Free-running sources: the connection's gate, if it may be held ([`crate::builder::hold`]).
        gate: Option<Arc<ReadGate>>,
    },
    Rejected {
        reason: &'static str,
    },
    /// Pull: requests for `source` go back on this connection.
    Hello {
        source: SourceId,
        requests: mpsc::UnboundedSender<Bytes>,
    },
    /// Pull: connected to the data-flow manager (what to write to it), and its assignments.
    DfmUp {
        out: mpsc::UnboundedSender<Bytes>,
    },
    Assign {
        slice: SliceNumber,
    },
    /// What one read of a connection brought, in order ([`ToBuilder`]), with its room.
    Batch {
        messages: Vec<Incoming>,
        _room: tokio::sync::OwnedSemaphorePermit,
    },
}

/// Most frames of one read a connection's reader hands on in one message.
pub(super) const READ_BATCH: usize = 64;
/// Most batched frames on their way from the readers to the builder's loop, as the
/// channel's bound holds single messages.
pub(super) const BATCHED_IN_FLIGHT: usize = 4096;
const _: () = assert!(READ_BATCH <= BATCHED_IN_FLIGHT, "a batch must fit in the room for batches");

/// A connection reader's way to the builder's loop. The frames one read brought go in one
/// message: at small fragments a message per frame cost a channel operation and often a
/// wake-up each, hundreds of thousands a second.
#[derive(Clone)]
pub(super) struct ToBuilder {
    tx: mpsc::Sender<Incoming>,
    room: Arc<tokio::sync::Semaphore>,
}

impl ToBuilder {
    pub(super) fn new(tx: mpsc::Sender<Incoming>, room: &Arc<tokio::sync::Semaphore>) -> Self {
        Self { tx, room: room.clone() }
    }

    /// Sends `messages` (emptied) as one; false once the builder's loop is gone.
    async fn send(&self, messages: &mut Vec<Incoming>) -> bool {
        let sent = match messages.len() {
            0 => return true,
            1 => self.tx.send(messages.pop().expect("one")).await,
            n => {
                // At most READ_BATCH (`serve_frames`), within the semaphore's permits: more
                // than it has would wait for ever.
                debug_assert!(n <= READ_BATCH, "a batch of {n} frames");
                let Ok(room) = self.room.clone().acquire_many_owned(n as u32).await else {
                    return false;
                };
                self.tx.send(Incoming::Batch { messages: std::mem::take(messages), _room: room }).await
            }
        };
        sent.is_ok()
    }
}

/// What every connection of the data port is read with.
#[derive(Clone)]
pub(super) struct Reading {
    pub(super) max_payload: u32,
    pub(super) clock: WallClock,
    /// Free-running sources: how far their connections may run ahead.
    pub(super) edge: Option<Arc<WindowEdge>>,
    pub(super) to: ToBuilder,
    pub(super) cancel: CancellationToken,
    /// The run's slice clock and how far ahead of now a fragment may be
    /// ([`crate::builder::settings::FUTURE_HORIZON`]); none for free-running sources.
    pub(super) horizon: Option<(SliceClock, std::time::Duration)>,
}

/// One accepted connection: who it is and what it may send as.
struct Peer {
    addr: SocketAddr,
    speaker: Speaker,
}

/// Reads one source connection (epoll path): validated frames go to the assembler task.
async fn read_connection(stream: shoal_tls::DataStream, peer: Peer, r: Reading) {
    let (read, write) = stream.into_split();
    let reader = FrameReader::new(read, peer.addr, r.max_payload, r.cancel.clone())
        .first_frame_within(crate::transport::listen::FIRST_FRAME_WITHIN);
    serve_with_requests(reader, write, peer.speaker, r).await;
}

/// [`serve_frames`] on a task's connection: pull requests for the sources that greet it
/// go back on its write half, written by a task of their own until the frames end.
async fn serve_with_requests<F: Frames>(frames: F, write: shoal_tls::data::DataWrite, speaker: Speaker, r: Reading) {
    let (requests, requests_rx) = mpsc::unbounded_channel();
    let ended = CancellationToken::new();
    tokio::spawn(write_queued_until(write, requests_rx, ended.clone()));
    let checks = Checks { speaker, horizon: r.horizon };
    serve_frames(frames, requests, checks, r.clock, ConnectionGate::new(r.edge), r.to).await;
    ended.cancel();
}

/// The `ucx` path's [`read_connection`]: the welcome on the TCP side, then the frames
/// that come as UCX messages ([`crate::transport::ucx`]).
async fn ucx_connection(receiver: Arc<UcxReceiver>, stream: shoal_tls::DataStream, peer: Peer, r: Reading) {
    let opened = UcxFrames::open(&receiver, stream, peer.addr, r.max_payload, r.cancel.clone()).await;
    let (frames, write) = match opened {
        Ok(f) => f,
        Err(e) => {
            // Gone before its welcome: as a TCP connection that closes at once.
            tracing::debug!(peer = %peer.addr, error = %e, "writing the UCX welcome");
            return;
        }
    };
    serve_with_requests(frames, write, peer.speaker, r).await;
}

/// The io_uring path's [`read_connection`]: the same frames, read on the io_uring thread.
fn uring_connection(
    peer: Peer,
    r: Reading,
    place: crate::transport::listen::ConnectionPlace,
) -> crate::transport::uring::ConnectionTask {
    Box::new(move |stream| {
        Box::pin(async move {
            let (requests, requests_rx) = mpsc::unbounded_channel();
            let ended = CancellationToken::new();
            tokio_uring::spawn(stream.clone().write_queued(requests_rx, ended.clone()));
            let reader = FrameReader::new(stream, peer.addr, r.max_payload, r.cancel)
                .first_frame_within(crate::transport::listen::FIRST_FRAME_WITHIN);
            let checks = Checks { speaker: peer.speaker, horizon: r.horizon };
            serve_frames(reader, requests, checks, r.clock, ConnectionGate::new(r.edge), r.to).await;
            ended.cancel();
            drop(place);
        })
    })
}

/// Validates one connection's frames and passes them on, those of one read in one message;
/// source hellos register the connection for pull requests (`requests`). Waits at `gate`
/// while the builder holds the connection's fragments back (free-running sources too far
/// ahead: [`crate::builder::hold`]).
async fn serve_frames<F: Frames>(
    mut reader: F,
    requests: mpsc::UnboundedSender<Bytes>,
    checks: Checks,
    clock: WallClock,
    mut gate: ConnectionGate,
    to: ToBuilder,
) {
    let mut batch = Vec::new();
    let end = 'connection: loop {
        let mut next = match reader.next().await {
            Ok(f) => Some(f),
            Err(end) => break end,
        };
        // The frames of one read arrived together, whether or not one then waits for room
        // in the window (its delay includes the wait, as a fragment held by the builder's
        // loop counts its hold).
        let arrival = clock.now();
        let mut ended = None;
        while let Some(frame) = next.take() {
            match check_frame(&reader, &frame, &checks, arrival) {
                Err(end) => {
                    ended = Some(end);
                    break;
                }
                Ok(Some(source)) => batch.push(Incoming::Hello { source, requests: requests.clone() }),
                Ok(None) => {
                    let h = &frame.header;
                    let frame_gate = gate.for_frame(h.source);
                    if !h.flags.contains(Flags::END_OF_STREAM) && !gate.has_room(h.slice) {
                        // What came before goes in first: it may be what moves the window.
                        if !to.send(&mut batch).await {
                            break 'connection ReadEnd::Clean;
                        }
                        gate.wait_for_room(h.slice, to.tx.closed()).await;
                    }
                    batch.push(Incoming::Frame { frame, arrival, gate: frame_gate });
                }
            }
            // No more once the builder holds this connection: it would only hold them too.
            if batch.len() < READ_BATCH && !gate.is_shut() {
                match reader.next_buffered() {
                    Ok(f) => next = f,
                    Err(end) => ended = Some(end),
                }
            }
        }
        if !to.send(&mut batch).await {
            break ReadEnd::Clean;
        }
        if let Some(end) = ended {
            break end;
        }
        gate.pass(to.tx.closed()).await;
    };
    if let ReadEnd::Rejected(reason) = end {
        let _ = to.tx.send(Incoming::Rejected { reason }).await;
    }
}

/// What a connection's frames are checked against besides their format.
struct Checks {
    /// Who the connection is: the source ids it may send as.
    speaker: Speaker,
    /// The run's slice clock and how far ahead a fragment may be.
    horizon: Option<(SliceClock, std::time::Duration)>,
}

/// A frame on a data port checked: `Some(source)` for a source's hello (pull), `None` for
/// a fragment to take in, or the end of the connection for anything else. Every source id
/// (a fragment's, an end of stream's, a hello's) must be one the connection's certificate
/// holds, and a fragment's slice must begin within the horizon of `now`: either refusal
/// closes the connection before anything of the frame goes on.
fn check_frame<F: Frames>(
    reader: &F,
    frame: &Frame,
    checks: &Checks,
    now: Instant,
) -> Result<Option<SourceId>, ReadEnd> {
    let h = &frame.header;
    let speaker = &checks.speaker;
    if !speaker.may_send_as(h.source) {
        return Err(reader.reject("identity", &speaker.refuse("source", h.source)));
    }
    let is_data = !h.flags.intersects(Flags::CONTROL) && !h.flags.contains(Flags::END_OF_STREAM);
    if let Some((clock, horizon)) = &checks.horizon
        && is_data
        && clock.start_of(h.slice) > now + shoal_core::Duration::from_nanos(horizon.as_nanos() as u64)
    {
        crate::transport::secure::DATA_REFUSED.window.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let detail = format!("slice {} begins more than {horizon:?} after now, source {}", h.slice, h.source);
        return Err(reader.reject("window", &detail));
    }
    match PullMessage::from_frame(frame) {
        Ok(None) => {}
        Ok(Some(PullMessage::SourceHello { source })) => return Ok(Some(source)),
        Ok(Some(_)) => {
            return Err(reader.reject("unexpected_control", "only source hellos are expected on a data port"));
        }
        Err(e) => return Err(reader.reject(e.kind(), &e.to_string())),
    }
    if h.flags.contains(Flags::EVENTS) {
        return Err(reader.reject("unexpected_events", "an EVENTS frame on a data port"));
    }
    if h.flags.contains(Flags::RAW) {
        return Err(reader.reject("unexpected_raw", "a RAW frame on a data port"));
    }
    if h.flags.contains(Flags::OPAQUE) {
        // User data in no format shoal knows (the source SDK): stored, not parsed.
        if h.hit_count != 0 {
            return Err(reader.reject("opaque_with_hits", "an OPAQUE frame claims hits"));
        }
    } else if let Err(e) = HitPayload::parse(&frame.payload, h.hit_count) {
        return Err(reader.reject("bad_payload", &e.to_string()));
    }
    Ok(None)
}

/// Accepts the data port's connections until the reading's `cancel`, each read by a task
/// of its own (or on the io_uring thread), at most `limit` at once; returns how many it
/// accepted.
pub(super) async fn accept_connections(
    listener: tokio::net::TcpListener,
    limit: crate::transport::listen::ConnectionLimit,
    uring: Option<crate::transport::uring::UringReceiver>,
    ucx: Option<Arc<UcxReceiver>>,
    port: DataPort,
    reading: Reading,
) -> u64 {
    let uring = uring.map(Arc::new);
    let cancel = reading.cancel.clone();
    let rejected_to = reading.to.tx.clone();
    let serve = |stream: tokio::net::TcpStream, addr, place| {
        let _ = stream.set_nodelay(true);
        let (port, uring, ucx, r) = (port.clone(), uring.clone(), ucx.clone(), reading.clone());
        let to_uring = |uring: &crate::transport::uring::UringReceiver, tcp, peer: Peer, r, place| {
            let addr = peer.addr;
            if !uring.submit(tcp, uring_connection(peer, r, place)) {
                // Closed: the source reconnects, and its link counts it.
                warn!(peer = %addr, "the io_uring receive thread is gone: connection closed");
            }
        };
        if port.mode() == shoal_tls::DataSecurity::Off && ucx.is_none() {
            // Nothing to wait for: a plain connection goes to the io_uring thread as it is.
            if let Some(uring) = &uring {
                return to_uring(uring, stream, Peer { addr, speaker: Speaker::anyone() }, r, place);
            }
        }
        // The handshake (if any) first, in the connection's own task: a slow or hostile
        // peer holds only its own place.
        tokio::spawn(async move {
            let Some((stream, speaker)) = crate::transport::secure::accept(&port, stream, addr, "data").await else {
                return;
            };
            let mut place = place;
            if let Some(name) = speaker.identity() {
                place.identify(name);
            }
            let peer = Peer { addr, speaker };
            match (stream, &uring, ucx) {
                (stream, _, Some(receiver)) => ucx_connection(receiver, stream, peer, r).await,
                // `authenticated`: a plain socket after the handshake, read where plain ones are.
                (shoal_tls::DataStream::Plain(tcp), Some(uring), None) => return to_uring(uring, tcp, peer, r, place),
                // TLS is read by a task (io_uring reads bytes the TLS layer has to decrypt).
                (stream, _, None) => read_connection(stream, peer, r).await,
            }
            drop(place);
        });
    };
    let rejected = || {
        let tx = rejected_to.clone();
        async move {
            let _ = tx.send(Incoming::Rejected { reason: "connection_limit" }).await;
        }
    };
    crate::transport::listen::accept_loop(listener, "data", limit, cancel, serve, rejected).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration as StdDuration;

    use shoal_core::frame::{self, FrameHeader};

    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A data fragment of source 0 for `slice`, encoded.
    fn fragment(slice: u64) -> Bytes {
        let header = FrameHeader {
            flags: Flags::EMPTY,
            source: 0,
            hit_count: 0,
            slice,
            slice_start: Instant::ZERO,
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        frame::encode(&header, &[])
    }

    /// A reader of one accepted connection, its peer's end, and where its messages go.
    async fn reader_and_peer(
        edge: Option<Arc<WindowEdge>>,
    ) -> (tokio::task::JoinHandle<()>, TcpStream, mpsc::Receiver<Incoming>) {
        reader_checking(edge, None).await
    }

    /// [`reader_and_peer`] with the run's slice clock and a horizon.
    async fn reader_checking(
        edge: Option<Arc<WindowEdge>>,
        horizon: Option<(SliceClock, std::time::Duration)>,
    ) -> (tokio::task::JoinHandle<()>, TcpStream, mpsc::Receiver<Incoming>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (stream, addr) = listener.accept().await.unwrap();
        let reader = FrameReader::new(stream, addr, 1 << 20, CancellationToken::new());
        let (tx, rx) = mpsc::channel(4096);
        let to = ToBuilder::new(tx, &Arc::new(tokio::sync::Semaphore::new(BATCHED_IN_FLIGHT)));
        let (requests, _) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve_frames(
            reader,
            requests,
            Checks { speaker: Speaker::anyone(), horizon },
            WallClock::new(),
            ConnectionGate::new(edge),
            to,
        ));
        (task, peer, rx)
    }

    /// The next message's fragments' slices (a batch's in order), or the rejection's reason.
    async fn next_message(rx: &mut mpsc::Receiver<Incoming>) -> Option<Result<Vec<u64>, &'static str>> {
        // Guards against a hang only: a reader that kept what it read would never send.
        let m = tokio::time::timeout(StdDuration::from_secs(60), rx.recv()).await.expect("the reader sent nothing");
        let slice = |m: Incoming| match m {
            Incoming::Frame { frame, .. } => frame.header.slice,
            _ => panic!("a fragment expected"),
        };
        Some(match m? {
            Incoming::Batch { messages, .. } => Ok(messages.into_iter().map(slice).collect()),
            Incoming::Rejected { reason } => Err(reason),
            m => Ok(vec![slice(m)]),
        })
    }

    /// The slices of every fragment that went in, and the reason of the rejection that ended
    /// the connection.
    async fn until_rejected(rx: &mut mpsc::Receiver<Incoming>) -> (Vec<u64>, &'static str) {
        let mut slices = Vec::new();
        loop {
            match next_message(rx).await.expect("a rejection ends it") {
                Ok(s) => slices.extend(s),
                Err(reason) => return (slices, reason),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_fragments_before_a_bad_frame_go_in_in_order_then_the_connection_is_rejected() {
        let (task, mut peer, mut rx) = reader_and_peer(None).await;
        let mut bytes: Vec<u8> = (1..=200).flat_map(|s| fragment(s).to_vec()).collect();
        bytes.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        peer.write_all(&bytes).await.unwrap();
        let (slices, reason) = until_rejected(&mut rx).await;
        assert_eq!(slices, (1..=200).collect::<Vec<_>>());
        assert_eq!(reason, "bad_magic");
        task.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_hands_on_what_it_read_before_it_waits_for_room_in_the_window() {
        // The window is full up to slice 5: the fragment of 6 waits, but those before it
        // may be what moves the window, so they go in first.
        let edge = WindowEdge::new();
        edge.publish(Some(5));
        let (task, mut peer, mut rx) = reader_and_peer(Some(edge.clone())).await;
        let bytes: Vec<u8> = (1..=8).flat_map(|s| fragment(s).to_vec()).collect();
        peer.write_all(&bytes).await.unwrap();
        let mut slices = Vec::new();
        while slices.len() < 5 {
            slices.extend(next_message(&mut rx).await.expect("open").unwrap());
        }
        assert_eq!(slices, [1, 2, 3, 4, 5]);
        assert!(rx.try_recv().is_err(), "the fragment of slice 6 went in past the window");
        edge.publish(None);
        while slices.len() < 8 {
            slices.extend(next_message(&mut rx).await.expect("open").unwrap());
        }
        assert_eq!(slices, (1..=8).collect::<Vec<_>>());
        drop(peer);
        assert!(next_message(&mut rx).await.is_none(), "a clean end sends nothing more");
        task.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fragment_for_a_slice_beyond_the_horizon_closes_its_connection_after_those_before() {
        // 10 ms slices; a horizon of 2 s: slice 1 (1970) is long past, the slice of now
        // plus a minute is not to be.
        let clock = SliceClock::new(shoal_core::Duration::from_millis(10));
        let (task, mut peer, mut rx) = reader_checking(None, Some((clock, StdDuration::from_secs(2)))).await;
        let ahead = clock.slice_at(WallClock::new().now() + shoal_core::Duration::from_secs(60));
        let before = crate::transport::secure::DATA_REFUSED.window.load(std::sync::atomic::Ordering::Relaxed);
        let bytes: Vec<u8> = [1, 2, ahead, 3].iter().flat_map(|&s| fragment(s).to_vec()).collect();
        peer.write_all(&bytes).await.unwrap();
        let (slices, reason) = until_rejected(&mut rx).await;
        assert_eq!((slices, reason), (vec![1, 2], "window"));
        let after = crate::transport::secure::DATA_REFUSED.window.load(std::sync::atomic::Ordering::Relaxed);
        assert!(after > before, "counted");
        task.await.unwrap();
    }
}
