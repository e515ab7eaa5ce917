//! shoal-ucx: a safe UCX worker for shoal's `ucx` transport (`run.transport = "ucx"`).
//!
//! UCX's workers are single-threaded objects driven by progress calls; this crate gives
//! each [`Worker`] a thread of its own that owns the UCX context and worker, waits on the
//! worker's event descriptor (`ucp_worker_get_efd`, re-armed by `ucp_worker_arm`) in
//! tokio's [`AsyncFd`](tokio::io::unix::AsyncFd) on a current-thread runtime, and takes
//! commands from the rest of the process through a channel. Nothing outside the thread
//! touches a UCX handle.
//!
//! What it offers is what the transport needs and no more:
//! - [`Worker::start`]: the thread, with what it [`Receive`]s: the active-message ids, the
//!   [`Sink`] that gets them (called on the worker thread, in the order they complete) and
//!   the size of its receive [`Region`];
//! - [`Worker::address`]: the worker's address, for the peer to connect to (exchanged out
//!   of band: shoal sends it over the TCP connection it already has);
//! - [`Worker::connect`] → [`Endpoint`]: an endpoint with peer-failure handling
//!   (`UCP_ERR_HANDLING_MODE_PEER`), one UCX endpoint per peer worker shared by every
//!   [`Endpoint`] to it; [`Endpoint::failed`] resolves when UCX reports the peer
//!   gone;
//! - [`Endpoint::send`]: one active message (`ucp_am_send_nbx`), a header and a payload in
//!   parts (an iovec: the payload is never copied into one buffer). UCX picks eager or
//!   rendezvous by size; a rendezvous receive lands the payload straight in a slot of the
//!   receiver's region (`ucp_am_recv_data_nbx`): over `cma` one copy between processes,
//!   over RDMA none by the CPU.
//!
//! The [`Region`] is registered with UCX once (`ucp_mem_map`, its handle passed with every
//! receive), as flesnet and ALICE register their buffers, instead of UCX registering (on
//! RDMA: pinning) each buffer as it comes. It is also the receiver's back-pressure: while it
//! is full a rendezvous waits (the handler returns `UCS_INPROGRESS` and the receive is
//! posted when a slot comes back), which holds its sender's operation and so its window.
//!
//! Built without the system's UCX (ucx-sys's probe failed), [`Worker::start`] returns
//! [`UcxError::Unavailable`] saying what is missing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};

#[cfg(not(ucx_missing))]
mod exit;
pub mod region;
#[cfg(not(ucx_missing))]
mod thread;

pub use region::Region;

/// Why a UCX operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    #[error(
        "this shoal was built without UCX: the ucx transport needs UCX 1.13 or newer (Debian's \
         libucx-dev, or PKG_CONFIG_PATH pointing at the site's UCX) when shoal is built"
    )]
    Unavailable,
    /// A UCX call returned an error status.
    #[error("{call}: {status}")]
    Status { call: &'static str, status: String },
    /// The worker's thread has ended (its owner dropped it, or it failed).
    #[error("the UCX worker has ended")]
    WorkerGone,
}

/// One received active message: its id, its header and its payload (whole: the
/// rendezvous's data has landed when the sink sees it), or why the payload could not be
/// fetched.
#[derive(Debug)]
pub struct Message {
    pub id: u16,
    pub header: Bytes,
    pub data: Result<Bytes, UcxError>,
    /// The payload came by rendezvous (fetched by this side) rather than eagerly.
    pub rendezvous: bool,
}

/// Where a worker's received messages go, called on the worker's thread.
pub type Sink = Box<dyn FnMut(Message) + Send>;

/// What a worker receives and where it puts it.
pub struct Receive {
    /// The active-message ids it takes, each handed to `sink`.
    pub ids: Vec<u16>,
    pub sink: Sink,
    /// Bytes registered with UCX once (`ucp_mem_map`) for the payloads to land in: a
    /// rendezvous waits (holding its sender) while the region is full, so this is the
    /// most payload the receiver holds. 0: a buffer allocated per message, no limit.
    pub region_bytes: usize,
}

/// A worker's counters, readable from any thread.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub messages_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub send_errors: AtomicU64,
    pub messages_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub rendezvous_received: AtomicU64,
    /// Rendezvous receives that waited for room in the region (its holder's back-pressure).
    pub receives_deferred: AtomicU64,
    /// Payloads received outside the region (larger than it, or no region).
    pub received_outside_region: AtomicU64,
    pub receive_errors: AtomicU64,
    pub endpoint_failures: AtomicU64,
    /// UCX endpoints made (one per peer worker, shared by the [`Endpoint`]s to it).
    pub endpoints_created: AtomicU64,
}

impl WorkerStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Where an endpoint's failure is told (`None` while it is well).
type FailureWatch = watch::Receiver<Option<UcxError>>;

/// What the owner asks of the worker's thread.
#[cfg_attr(ucx_missing, allow(dead_code))]
enum Command {
    Connect { remote: Vec<u8>, reply: oneshot::Sender<Result<(u64, FailureWatch), UcxError>> },
    Send { endpoint: u64, id: u16, header: Bytes, data: Vec<Bytes>, done: oneshot::Sender<Result<(), UcxError>> },
    Close { endpoint: u64 },
}

/// A UCX context and worker on a thread of their own. The thread ends once this and every
/// [`Endpoint`] of it are dropped (each holds a way to it): it waits a bounded time for
/// what is in flight, closes the endpoints (cancelling what is still in flight then), and
/// destroys the worker; at the process's exit every worker thread does so before UCX's
/// libraries go (`exit`).
pub struct Worker {
    commands: mpsc::UnboundedSender<Command>,
    address: Bytes,
    stats: Arc<WorkerStats>,
    region: Option<Arc<Region>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("address_len", &self.address.len()).finish()
    }
}

/// Whether this build can run UCX at all.
pub const AVAILABLE: bool = !cfg!(ucx_missing);

impl Worker {
    /// Starts the worker's thread, receiving what `receive` says (nothing: a worker that
    /// only sends). The transports and devices are UCX's choice under its usual
    /// environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).
    pub fn start(name: &str, receive: Option<Receive>) -> Result<Worker, UcxError> {
        #[cfg(ucx_missing)]
        {
            let _ = (name, receive);
            Err(UcxError::Unavailable)
        }
        #[cfg(not(ucx_missing))]
        {
            let stats = Arc::new(WorkerStats::default());
            let (commands, rx) = mpsc::unbounded_channel();
            let region = match &receive {
                Some(r) if r.region_bytes > 0 => Some(
                    Region::new(r.region_bytes)
                        .map_err(|e| UcxError::Status { call: "mapping the receive region", status: e.to_string() })?,
                ),
                _ => None,
            };
            let address = thread::spawn(name, receive, region.clone(), rx, stats.clone())?;
            Ok(Worker { commands, address, stats, region })
        }
    }

    /// The memory rendezvous payloads land in, if the worker has one.
    pub fn region(&self) -> Option<&Arc<Region>> {
        self.region.as_ref()
    }

    /// This worker's address, for a peer's [`Worker::connect`].
    pub fn address(&self) -> &Bytes {
        &self.address
    }

    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.stats
    }

    /// An endpoint to the worker at `remote` (its [`Worker::address`]): the UCX endpoint
    /// this worker already has to it, if it has a well one, else a new one.
    pub async fn connect(&self, remote: &[u8]) -> Result<Endpoint, UcxError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(Command::Connect { remote: remote.to_vec(), reply }).map_err(|_| UcxError::WorkerGone)?;
        let (id, failed) = rx.await.map_err(|_| UcxError::WorkerGone)??;
        Ok(Endpoint { id, commands: self.commands.clone(), failed })
    }
}

/// A use of the endpoint to one peer worker. The endpoint stays open once its last use is
/// dropped (for the next connection to that peer) until the worker ends; one whose peer
/// failed is closed with its last use.
#[derive(Debug)]
pub struct Endpoint {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    failed: FailureWatch,
}

impl Endpoint {
    /// Sends one active message: `header` (small: it travels with the first packet) and
    /// `data` in parts. The returned receiver says when UCX is done with the buffers (for
    /// a rendezvous, once the peer has fetched them) or why it failed.
    pub fn send(&self, id: u16, header: Bytes, data: Vec<Bytes>) -> oneshot::Receiver<Result<(), UcxError>> {
        let (done, rx) = oneshot::channel();
        if let Err(mpsc::error::SendError(Command::Send { done, .. })) =
            self.commands.send(Command::Send { endpoint: self.id, id, header, data, done })
        {
            let _ = done.send(Err(UcxError::WorkerGone));
        }
        rx
    }

    /// Resolves when UCX reports the peer failed (or the worker ends).
    pub async fn failed(&mut self) -> UcxError {
        match self.failed.wait_for(Option::is_some).await {
            Ok(e) => e.clone().unwrap_or(UcxError::WorkerGone),
            Err(_) => UcxError::WorkerGone,
        }
    }

    /// The peer's failure, if UCX has reported one.
    pub fn failure(&self) -> Option<UcxError> {
        self.failed.borrow().clone()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Close { endpoint: self.id });
    }
}

#[cfg(all(test, not(ucx_missing)))]
mod tests {
    use super::*;

    /// A sink that hands every message to the test.
    fn collecting_sink() -> (Sink, mpsc::UnboundedReceiver<Message>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let sink: Sink = Box::new(move |m| {
            let _ = tx.send(m);
        });
        (sink, rx)
    }

    /// Two workers of one process over whatever UCX picks (shared memory, cma, tcp):
    /// small and large messages arrive whole, payload parts joined. Not necessarily in
    /// order: an eager message sent after a rendezvous one can complete first (seen here:
    /// the 3-byte one before the 4 MiB one), which is why the transport numbers them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn messages_small_and_large_arrive_whole() {
        let (sink, mut rx) = collecting_sink();
        let receiver = Worker::start("test-rx", Some(Receive { ids: vec![7], sink, region_bytes: 0 })).unwrap();
        let sender = Worker::start("test-tx", None).unwrap();
        let ep = sender.connect(receiver.address()).await.unwrap();
        let sizes = [0usize, 1, 100, 8 << 10, 1 << 20, 4 << 20, 3];
        let mut done = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let body: Vec<u8> = (0..n).map(|k| (k * 31 + i) as u8).collect();
            let half = n / 2;
            let parts = vec![Bytes::copy_from_slice(&body[..half]), Bytes::copy_from_slice(&body[half..])];
            done.push(ep.send(7, Bytes::from(vec![i as u8; 16]), parts));
        }
        for d in done {
            d.await.unwrap().unwrap();
        }
        let mut got = Vec::new();
        for _ in &sizes {
            got.push(rx.recv().await.unwrap());
        }
        got.sort_by_key(|m| m.header[0]);
        for ((i, &n), m) in sizes.iter().enumerate().zip(got) {
            assert_eq!(m.id, 7);
            assert_eq!(&m.header[..], &[i as u8; 16][..]);
            let data = m.data.unwrap();
            assert_eq!(data.len(), n, "message {i}");
            assert!(data.iter().enumerate().all(|(k, &b)| b == (k * 31 + i) as u8), "message {i}'s bytes");
        }
        assert_eq!(WorkerStats::get(&receiver.stats().messages_received), sizes.len() as u64);
        assert!(WorkerStats::get(&receiver.stats().rendezvous_received) >= 1, "4 MiB went by rendezvous");
    }

    /// A region with room for two 1 MiB payloads: while the receiver holds two, the third
    /// waits (deferred, its sender held); once they are dropped every payload lands, whole,
    /// and the region is empty again. One larger than the region arrives outside it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_region_holds_its_senders_back_and_loses_nothing() {
        let (sink, mut rx) = collecting_sink();
        let region_bytes = (5 << 20) / 2;
        let receiver = Worker::start("test-rx", Some(Receive { ids: vec![7], sink, region_bytes })).unwrap();
        let region = receiver.region().expect("a region").clone();
        let sender = Worker::start("test-tx", None).unwrap();
        let ep = sender.connect(receiver.address()).await.unwrap();
        let mut sizes = vec![1usize << 20; 6];
        sizes.push(3 << 20);
        let body = |i: usize, n: usize| -> Vec<u8> { (0..n).map(|k| (k * 7 + i) as u8).collect() };
        let done: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| ep.send(7, Bytes::from(vec![i as u8; 16]), vec![Bytes::from(body(i, n))]))
            .collect();
        let check = |m: Message| {
            let i = m.header[0] as usize;
            let data = m.data.unwrap();
            assert_eq!(data.len(), sizes[i], "message {i}");
            assert!(data[..] == body(i, sizes[i])[..], "message {i}'s bytes");
            i
        };
        // Hold what lands until the region is full and a receive has had to wait.
        let mut held = Vec::new();
        let mut seen = Vec::new();
        for _ in 0..6000 {
            if WorkerStats::get(&receiver.stats().receives_deferred) > 0 {
                break;
            }
            match tokio::time::timeout(std::time::Duration::from_millis(10), rx.recv()).await {
                Ok(m) => held.push(m.unwrap()),
                Err(_) => continue,
            }
        }
        assert!(WorkerStats::get(&receiver.stats().receives_deferred) > 0, "a receive waited for room");
        assert!(region.in_use() > 0 && region.in_use() <= region.len());
        seen.extend(held.drain(..).map(check));
        while seen.len() < sizes.len() {
            seen.push(check(rx.recv().await.unwrap()));
        }
        for d in done {
            d.await.unwrap().unwrap();
        }
        seen.sort();
        assert_eq!(seen, (0..sizes.len()).collect::<Vec<_>>());
        assert_eq!(region.in_use(), 0, "every slot came back");
        assert!(region.peak_in_use.load(Ordering::Relaxed) as usize <= region.len());
        assert_eq!(WorkerStats::get(&receiver.stats().received_outside_region), 1, "the 3 MiB one");
    }

    /// Two connections to one peer share its UCX endpoint: both carry messages, the first
    /// one's drop leaves the second's working, and once both are gone the endpoint stays
    /// open for the next connection to that peer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_to_one_peer_share_its_endpoint() {
        let (sink, mut rx) = collecting_sink();
        let receiver = Worker::start("test-rx", Some(Receive { ids: vec![7], sink, region_bytes: 0 })).unwrap();
        let sender = Worker::start("test-tx", None).unwrap();
        let created = || WorkerStats::get(&sender.stats().endpoints_created);
        let (a, b) =
            (sender.connect(receiver.address()).await.unwrap(), sender.connect(receiver.address()).await.unwrap());
        assert_eq!(created(), 1, "the second connection made an endpoint of its own");
        let sent =
            |ep: &Endpoint, tag: u8| ep.send(7, Bytes::from(vec![tag; 4]), vec![Bytes::from(vec![tag; 100_000])]);
        let (da, db) = (sent(&a, 1), sent(&b, 2));
        da.await.unwrap().unwrap();
        db.await.unwrap().unwrap();
        drop(a);
        sent(&b, 3).await.unwrap().unwrap();
        let mut tags: Vec<u8> = Vec::new();
        for _ in 0..3 {
            let m = rx.recv().await.unwrap();
            assert_eq!(m.data.unwrap().len(), 100_000);
            tags.push(m.header[0]);
        }
        tags.sort();
        assert_eq!(tags, [1, 2, 3]);
        drop(b);
        let c = sender.connect(receiver.address()).await.unwrap();
        assert_eq!(created(), 1, "a connection after the last one's end did not take the open endpoint");
        sent(&c, 4).await.unwrap().unwrap();
        assert_eq!(rx.recv().await.unwrap().header[0], 4);
    }

    #[tokio::test]
    async fn an_address_that_is_not_one_is_an_error_not_a_crash() {
        let w = Worker::start("test", None).unwrap();
        // UCX parses the address; garbage must come back as a status, not abort.
        let short = w.connect(&[0u8; 2]).await;
        assert!(short.is_err(), "{short:?}");
    }
}
