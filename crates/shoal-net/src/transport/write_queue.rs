//! Control frames queued to one connection's write half: a builder's requests and credits
//! on a source connection, the data-flow manager's assignments on a builder connection.

use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Writes queued control frames to one connection until the queue closes or a write fails.
pub async fn write_queued(w: impl AsyncWrite + Unpin, rx: mpsc::UnboundedReceiver<Bytes>) {
    write_queued_until(w, rx, CancellationToken::new()).await
}

/// [`write_queued`] that also closes once `ended` is cancelled (after what is queued by
/// then): a source connection whose reader has seen the source's end. The source waits for
/// this close before its process may end (`crate::transport::link`'s `PeerEnd`); in pull the request
/// queue's other ends live on in the routes until the run is over.
pub async fn write_queued_until(
    mut w: impl AsyncWrite + Unpin,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    ended: CancellationToken,
) {
    while let Some(b) = next_queued(&mut rx, &ended).await {
        if w.write_all(&b).await.is_err() {
            return;
        }
    }
    let _ = w.shutdown().await;
}

/// The next control frame to write on a source connection: `None` once the queue has
/// closed, or once `ended` is cancelled and nothing is left queued.
pub async fn next_queued(rx: &mut mpsc::UnboundedReceiver<Bytes>, ended: &CancellationToken) -> Option<Bytes> {
    tokio::select! {
        biased;
        b = rx.recv() => b,
        _ = ended.cancelled() => rx.try_recv().ok(),
    }
}
