//! Live counters shared by the processes of one run (progress bar, monitoring).

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Live {
    pub fragments_produced: AtomicU64,
    pub fragments_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub slices_complete: AtomicU64,
    pub slices_incomplete: AtomicU64,
    pub events: AtomicU64,
    pub rejected_connections: AtomicU64,
}

impl Live {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}
