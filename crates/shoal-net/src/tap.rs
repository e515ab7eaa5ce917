//! Monitoring taps: a builder process publishes sampled raw slices and its selected events
//! on the dispatcher, for any ControlHost client (shoal's, km3pipe's `CHPump`, the PyPI
//! `controlhost` package) to subscribe to. Formats in docs/wire-format.md ("Monitoring
//! taps").
//!
//! The data path never waits for a tap: it offers each message to a bounded queue and
//! counts what did not fit; a task of its own, on a dispatcher connection of its own,
//! publishes the queue. A slow or absent subscriber costs tap messages, never slices.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use shoal_dispatcher::client::ChClient;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Sampled raw slices: every fragment of the slice as a data frame, concatenated.
pub const TAG_RAW: &str = "SHL_RAW";
/// Selected events of every processed slice: the `EVENTS` frame the writer receives.
pub const TAG_EVENTS: &str = "SHL_EVT";
/// Messages, and bytes, waiting for the dispatcher before new ones are dropped (a KM3NeT
/// builder offers a JDAQEvent per event: many small messages).
pub const QUEUE: usize = 65_536;
pub const QUEUE_BYTES: u64 = 64 << 20;

/// What the taps did (totals since the process started).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TapStats {
    pub published: u64,
    /// Offered but dropped: the queue was full (dispatcher slow or unreachable).
    pub dropped: u64,
    /// Dropped because publishing failed (connection lost).
    pub failed: u64,
}

/// A process's tap queue; closed (offers ignored) until [`Tap::open`].
#[derive(Debug, Default)]
pub struct Tap {
    tx: Mutex<Option<mpsc::Sender<(&'static str, Bytes)>>>,
    /// Bytes offered and not yet taken by the publisher.
    queued_bytes: AtomicU64,
    published: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

impl Tap {
    /// Starts publishing to `dispatcher` until `cancel`.
    pub fn open(
        self: &std::sync::Arc<Self>,
        dispatcher: SocketAddr,
        tls: Option<shoal_dispatcher::client::ControlTls>,
        cancel: CancellationToken,
    ) {
        let (tx, rx) = mpsc::channel(QUEUE);
        *self.tx.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        tokio::spawn(publish(self.clone(), dispatcher, tls, rx, cancel));
    }

    pub fn is_open(&self) -> bool {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Offers a message; never waits. Dropped (counted) when the queue is full.
    pub fn offer(&self, tag: &'static str, payload: Bytes) {
        let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = guard.as_ref() else { return };
        let len = payload.len() as u64;
        if self.queued_bytes.fetch_add(len, Ordering::AcqRel) + len > QUEUE_BYTES {
            self.queued_bytes.fetch_sub(len, Ordering::AcqRel);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if tx.try_send((tag, payload)).is_err() {
            self.queued_bytes.fetch_sub(len, Ordering::AcqRel);
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn stats(&self) -> TapStats {
        TapStats {
            published: self.published.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

async fn publish(
    tap: std::sync::Arc<Tap>,
    dispatcher: SocketAddr,
    tls: Option<shoal_dispatcher::client::ControlTls>,
    mut rx: mpsc::Receiver<(&'static str, Bytes)>,
    cancel: CancellationToken,
) {
    let mut client: Option<ChClient> = None;
    let mut delay = Duration::from_millis(100);
    loop {
        let (tag, payload) = tokio::select! {
            m = rx.recv() => match m { Some(m) => m, None => return },
            _ = cancel.cancelled() => return,
        };
        tap.queued_bytes.fetch_sub(payload.len() as u64, Ordering::AcqRel);
        if client.is_none() {
            match ChClient::connect_with(dispatcher, tls.clone()).await {
                Ok(mut c) => {
                    let _ = c.set_nickname("shoal-tap").await;
                    client = Some(c);
                    delay = Duration::from_millis(100);
                }
                Err(e) => {
                    // Messages offered meanwhile pile up to the queue's bound, then drop.
                    warn!(%dispatcher, error = %e, "tap cannot reach the dispatcher");
                    tap.failed.fetch_add(1, Ordering::Relaxed);
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = cancel.cancelled() => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        }
        let c = client.as_mut().expect("connected above");
        match c.publish(tag, &payload).await {
            Ok(()) => {
                tap.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                warn!(%dispatcher, error = %e, "tap lost the dispatcher");
                tap.failed.fetch_add(1, Ordering::Relaxed);
                client = None;
            }
        }
    }
}
