//! Helpers shared by the dispatcher's integration tests.

use std::time::Duration;

use shoal_dispatcher::server::{DispatcherHandle, Snapshot};

/// Polls the dispatcher's state until `pred` holds (bounded: 20 s).
pub async fn wait_until(h: &DispatcherHandle, what: &str, pred: impl Fn(&Snapshot) -> bool) -> Snapshot {
    for _ in 0..2000 {
        let s = h.snapshot().await.unwrap();
        if pred(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}: {:?}", h.snapshot().await);
}
