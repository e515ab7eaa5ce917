//! The runtime's clock: shoal [`Instant`]s are UNIX nanoseconds, so every process on every
//! host derives the same slice numbers as long as the hosts' clocks agree. Read once from
//! the system clock at start, then advanced by the monotonic clock so that it never jumps
//! backwards during a run.
//!
//! Run control measures how far each process's clock is from its own and tells it a
//! correction before a run (docs/clocks.md); [`WallClock::corrected`] applies it. For tests
//! and the testbed a clock can be given an error on purpose ([`WallClock::skewed`], `shoal
//! node --test-clock-offset-us/--test-clock-drift-ppm`): Linux time namespaces do not move
//! CLOCK_REALTIME, so hosts with different clocks are emulated here.

use shoal_core::Instant;

#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    anchor: std::time::Instant,
    anchor_unix_ns: u64,
    /// Added to the host's time: an injected error, less run control's correction, ns.
    offset_ns: i64,
    /// The clock runs fast by this many parts per billion (injected, tests only).
    drift_ppb: i64,
    /// The correction applied so far (run control's), ns.
    correction_ns: i64,
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl WallClock {
    pub fn new() -> Self {
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self {
            anchor: std::time::Instant::now(),
            anchor_unix_ns: unix.as_nanos() as u64,
            offset_ns: 0,
            drift_ppb: 0,
            correction_ns: 0,
        }
    }

    /// This clock, `offset_ns` ahead (negative: behind) and running fast by `drift_ppb`
    /// (tests and the testbed: an emulated host clock).
    pub fn skewed(self, offset_ns: i64, drift_ppb: i64) -> Self {
        Self { offset_ns: self.offset_ns + offset_ns, drift_ppb: self.drift_ppb + drift_ppb, ..self }
    }

    /// This clock with run control's correction `by_ns` subtracted (replacing any earlier
    /// correction): `by_ns` is how far the uncorrected clock is ahead of run control's.
    pub fn corrected(self, by_ns: i64) -> Self {
        let uncorrected = self.offset_ns + self.correction_ns;
        Self { offset_ns: uncorrected - by_ns, correction_ns: by_ns, ..self }
    }

    /// The correction in effect, ns.
    pub fn correction_ns(&self) -> i64 {
        self.correction_ns
    }

    /// Host time since the anchor, with the injected drift.
    fn elapsed_ns(&self) -> i64 {
        let e = self.anchor.elapsed().as_nanos() as i64;
        e + (e as i128 * self.drift_ppb as i128 / 1_000_000_000) as i64
    }

    pub fn now(&self) -> Instant {
        let t = self.anchor_unix_ns as i64 + self.elapsed_ns() + self.offset_ns;
        Instant::from_nanos(t.max(0) as u64)
    }

    /// The tokio deadline for a shoal instant (for `sleep_until`).
    pub fn deadline(&self, t: Instant) -> tokio::time::Instant {
        let since_anchor = (t.as_nanos() as i64 - self.anchor_unix_ns as i64 - self.offset_ns).max(0);
        // Undo the drift: host time runs 1 + drift_ppb / 1e9 times as fast as the anchor's.
        let host = (since_anchor as i128 * 1_000_000_000 / (1_000_000_000 + self.drift_ppb as i128)) as u64;
        tokio::time::Instant::from_std(self.anchor) + std::time::Duration::from_nanos(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_and_correction_add_up() {
        let base = WallClock::new();
        let ahead = base.skewed(3_000_000, 0);
        let d = ahead.now().as_nanos() as i64 - base.now().as_nanos() as i64;
        // Read one after the other: the second is later, by far less than a millisecond.
        assert!((2_000_000..3_000_000 + 1_000_000).contains(&d), "{d}");
        let fixed = ahead.corrected(3_000_000);
        assert_eq!(fixed.correction_ns(), 3_000_000);
        let d = fixed.now().as_nanos() as i64 - base.now().as_nanos() as i64;
        assert!(d.abs() < 1_000_000, "{d}");
        // A new correction replaces the old one.
        assert_eq!(fixed.corrected(1_000).offset_ns, 3_000_000 - 1_000);
    }

    #[test]
    fn a_deadline_maps_back_through_offset_and_drift() {
        let c = WallClock::new().skewed(-5_000_000, 200_000); // 5 ms behind, 200 ppm fast
        let t = Instant::from_nanos(c.anchor_unix_ns + 1_000_000_000);
        let host = c.deadline(t).into_std().duration_since(c.anchor).as_nanos() as i64;
        // 1 s + 5 ms of shoal time is 1.005 s / 1.0002 of host time.
        let expect = (1_005_000_000f64 / 1.0002) as i64;
        assert!((host - expect).abs() <= 1, "{host} vs {expect}");
    }
}
