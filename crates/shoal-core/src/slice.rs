//! Slice numbers, the slice clock and the static slice-to-builder rule.
//!
//! Slice `n` covers `[origin + n * length, origin + (n + 1) * length)`. With the runtime's
//! origin (the UNIX epoch) every process on every host derives the same slice numbers from
//! its (NTP-synchronised) clock, with no coordination message.

use crate::{BuilderId, Duration, Instant};

/// A time-slice number.
pub type SliceNumber = u64;

/// Maps instants to slice numbers and back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceClock {
    length_ns: u64,
}

impl SliceClock {
    /// A clock with slices of `length`. Panics on a zero length: that is a programming error,
    /// configurations are validated before they reach here (see [`SliceClock::try_new`]).
    pub fn new(length: Duration) -> Self {
        Self::try_new(length).expect("slice length must be between 1 ns and u64::MAX ns")
    }

    /// A clock with slices of `length`, or `None` when the length is zero or too large.
    pub fn try_new(length: Duration) -> Option<Self> {
        let length_ns = u64::try_from(length.as_nanos()).ok()?;
        (length_ns > 0).then_some(Self { length_ns })
    }

    pub fn length(&self) -> Duration {
        Duration::from_nanos(self.length_ns)
    }

    /// The slice that contains `t`.
    pub fn slice_at(&self, t: Instant) -> SliceNumber {
        t.as_nanos() / self.length_ns
    }

    /// The first instant of slice `n` (saturating).
    pub fn start_of(&self, n: SliceNumber) -> Instant {
        Instant::from_nanos(n.saturating_mul(self.length_ns))
    }

    /// The first instant after slice `n`, when its fragments are ready to send.
    pub fn end_of(&self, n: SliceNumber) -> Instant {
        self.start_of(n.saturating_add(1))
    }

    /// The first slice after the one containing `now` that starts on a whole second, so
    /// that processes started within the same second agree on it with no message (slices
    /// that do not divide a second: simply the next slice).
    pub fn first_on_a_second_after(&self, now: Instant) -> SliceNumber {
        let next = self.slice_at(now) + 1;
        if 1_000_000_000 % self.length_ns != 0 {
            return next;
        }
        let per_second = 1_000_000_000 / self.length_ns;
        next.div_ceil(per_second) * per_second
    }
}

/// The static round-robin rule of the reference design: `builder = slice mod n_builders`.
pub fn builder_for(slice: SliceNumber, n_builders: u32) -> BuilderId {
    assert!(n_builders > 0, "at least one builder");
    (slice % u64::from(n_builders)) as BuilderId
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_tile_time() {
        let c = SliceClock::new(Duration::from_millis(10));
        assert_eq!(c.slice_at(Instant::from_nanos(0)), 0);
        assert_eq!(c.slice_at(Instant::from_nanos(9_999_999)), 0);
        assert_eq!(c.slice_at(Instant::from_nanos(10_000_000)), 1);
        assert_eq!(c.start_of(3), Instant::from_nanos(30_000_000));
        assert_eq!(c.end_of(3), c.start_of(4));
        assert!(SliceClock::try_new(Duration::ZERO).is_none());
    }

    #[test]
    fn round_robin() {
        assert_eq!(builder_for(0, 3), 0);
        assert_eq!(builder_for(4, 3), 1);
        assert_eq!(builder_for(u64::MAX, 1), 0);
    }
}
