//! The runtime's clock: shoal [`Instant`]s are UNIX nanoseconds, so every process on every
//! (NTP-synchronised) host derives the same slice numbers. Read once from the system clock
//! at start, then advanced by the monotonic clock so that it never jumps backwards.

use shoal_core::Instant;

#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    anchor: std::time::Instant,
    anchor_unix_ns: u64,
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl WallClock {
    pub fn new() -> Self {
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self { anchor: std::time::Instant::now(), anchor_unix_ns: unix.as_nanos() as u64 }
    }

    pub fn now(&self) -> Instant {
        Instant::from_nanos(self.anchor_unix_ns + self.anchor.elapsed().as_nanos() as u64)
    }

    /// The tokio deadline for a shoal instant (for `sleep_until`).
    pub fn deadline(&self, t: Instant) -> tokio::time::Instant {
        let offset = std::time::Duration::from_nanos(t.as_nanos().saturating_sub(self.anchor_unix_ns));
        tokio::time::Instant::from_std(self.anchor) + offset
    }
}
