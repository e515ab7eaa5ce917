//! The builder's io_uring receive path (`builder.receive = "io_uring"`): its data
//! connections live on one thread of their own that runs a tokio-uring runtime, where every
//! read is an io_uring submission instead of an epoll wake-up followed by a `recvfrom`.
//!
//! The accept loop stays on the process's tokio runtime and hands each accepted socket
//! over ([`UringReceiver::submit`]) with the task that serves it. That task sees the socket
//! as a [`UringStream`]: [`crate::transport::framed::FrameReader`] reads frames from it like from a
//! tokio socket, and the builder's pull requests are written back on it. Frames leave the
//! thread through the same channel as on the epoll path, so everything downstream is
//! shared.
//!
//! The runtime is single-threaded: one core reads every connection, as the epoll path's
//! readers mostly do on a 2-core machine. docs/benchmarks.md "Connection scaling" compares
//! the two.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tokio_uring::buf::BoundedBuf;
use tracing::warn;

use crate::transport::framed::ReadSource;

/// What serves one connection on the io_uring thread.
pub type ConnectionTask = Box<dyn FnOnce(UringStream) -> Pin<Box<dyn Future<Output = ()>>> + Send>;

struct Job {
    stream: std::net::TcpStream,
    task: ConnectionTask,
}

/// The thread that owns the io_uring connections; it ends once the receiver is dropped
/// and every connection task has returned.
#[derive(Debug)]
pub struct UringReceiver {
    jobs: mpsc::UnboundedSender<Job>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

impl UringReceiver {
    /// Starts the thread; fails when this kernel (or its settings) refuses io_uring: a
    /// clear error at the start of the run, not a panic on the thread.
    pub fn start() -> std::io::Result<Self> {
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("uring-recv".into()).spawn(move || {
            let rt = match tokio_uring::Runtime::new(&tokio_uring::builder()) {
                Ok(rt) => {
                    let _ = ready_tx.send(Ok(()));
                    rt
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let mut tasks = Vec::new();
                while let Some(job) = rx.recv().await {
                    tasks.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
                    // Blocking mode: the ring waits for data itself; a socket left
                    // non-blocking could have its reads end in EAGAIN.
                    if let Err(e) = job.stream.set_nonblocking(false) {
                        warn!(error = %e, "io_uring receive: socket mode");
                        continue;
                    }
                    let stream = UringStream(Rc::new(tokio_uring::net::TcpStream::from_std(job.stream)));
                    tasks.push(tokio_uring::spawn((job.task)(stream)));
                }
                for t in tasks {
                    let _ = t.await;
                }
            })
        })?;
        ready.recv().map_err(|_| std::io::Error::other("the io_uring thread ended at its start"))??;
        Ok(Self { jobs })
    }

    /// Hands an accepted connection to the io_uring thread with the task that serves it.
    /// False when the thread is gone (the connection is closed).
    pub fn submit(&self, stream: tokio::net::TcpStream, task: ConnectionTask) -> bool {
        match stream.into_std() {
            Ok(stream) => self.jobs.send(Job { stream, task }).is_ok(),
            Err(e) => {
                warn!(error = %e, "io_uring receive: taking the socket from tokio");
                false
            }
        }
    }
}

/// One connection on the io_uring thread; clones share the socket (one task reads, one
/// writes the pull requests back).
#[derive(Clone)]
pub struct UringStream(Rc<tokio_uring::net::TcpStream>);

impl ReadSource for UringStream {
    /// A ring's read waits with its buffer submitted: there is no readiness to wait for
    /// apart from it.
    async fn ready(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        // The ring owns the buffer while the read is in flight; the bytes land after
        // what the decoder holds. (A read cancelled half-way takes the buffer with it:
        // cancellation ends the connection anyway.)
        let owned = std::mem::take(buf);
        let filled = owned.len();
        let (result, slice) = self.0.read(owned.slice(filled..)).await;
        *buf = slice.into_inner();
        result
    }
}

impl UringStream {
    /// Writes queued control frames until the queue closes, `ended` is cancelled or a
    /// write fails, then shuts the sending side (the io_uring twin of
    /// `write_queue::write_queued_until`).
    pub async fn write_queued(
        self,
        mut rx: mpsc::UnboundedReceiver<Bytes>,
        ended: tokio_util::sync::CancellationToken,
    ) {
        while let Some(b) = crate::transport::write_queue::next_queued(&mut rx, &ended).await {
            let (result, _) = self.0.write_all(b).await;
            if result.is_err() {
                return;
            }
        }
        let _ = self.0.shutdown(std::net::Shutdown::Write);
    }
}
