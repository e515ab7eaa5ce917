//! A sleep with microsecond resolution, for waits shorter than tokio's timer can express.
//!
//! tokio's timer counts in whole milliseconds and fires at the first tick at or after the
//! deadline, so a 0.4 ms wait takes 1 to 2 ms. A source whose token bucket refills in
//! under a millisecond then sleeps past the point where the bucket is full, and the tokens
//! it could have collected meanwhile are lost to the cap: at 100 Mbit/s with the default
//! burst it sent half its assigned rate (docs/benchmarks.md "Token bucket"). [`FineTimer`]
//! arms a `timerfd` (CLOCK_MONOTONIC, the clock `std::time::Instant` reads) and waits for
//! it through tokio's reactor, so the wait ends within the kernel's timer slack (50 us by
//! default).

use std::io;
use std::os::fd::OwnedFd;
use std::time::Instant;

use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// One re-armable timer (a `timerfd`); one per task that waits on it.
#[derive(Debug)]
pub struct FineTimer {
    fd: AsyncFd<OwnedFd>,
}

impl FineTimer {
    /// Inside a tokio runtime (its reactor watches the descriptor).
    pub fn new() -> io::Result<Self> {
        let fd = timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC)?;
        // Deprecated since tokio 1.54 for types whose descriptor can change or close
        // behind the reactor's back; an OwnedFd moved into the AsyncFd cannot, and the
        // replacement is an unsafe fn, which this workspace denies.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        Ok(Self { fd })
    }

    /// Waits until `deadline`. Cancel-safe: a wait dropped half-way leaves the timer armed,
    /// and the next call arms it afresh (which also forgets an expiry not yet read). Should
    /// the timer fail, the wait is tokio's (never a busy loop).
    pub async fn sleep_until(&self, deadline: Instant) {
        if self.try_sleep_until(deadline).await.is_err() {
            tokio::time::sleep_until(deadline.into()).await;
        }
    }

    async fn try_sleep_until(&self, deadline: Instant) -> io::Result<()> {
        let Some(wait) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Ok(());
        };
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        let value = Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
        rustix::time::timerfd_settime(
            self.fd.get_ref(),
            TimerfdTimerFlags::empty(),
            &Itimerspec { it_interval: zero, it_value: value },
        )?;
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expirations = [0u8; 8];
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                // A stale readiness (an expiry forgotten by re-arming): wait again.
                Err(_would_block) => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn it_waits_at_least_until_the_deadline_and_can_be_rearmed_after_a_cancelled_wait() {
        let t = FineTimer::new().unwrap();
        let deadline = Instant::now() + Duration::from_micros(300);
        t.try_sleep_until(deadline).await.unwrap();
        assert!(Instant::now() >= deadline, "woke before its deadline");
        // A long wait dropped half-way, then a short one: the short one ends (the long
        // one's arming is replaced), and a deadline in the past returns at once.
        let long = Instant::now() + Duration::from_secs(3600);
        let cancelled = tokio::time::timeout(Duration::from_millis(1), t.try_sleep_until(long)).await;
        assert!(cancelled.is_err(), "an hour's wait cannot end in a millisecond");
        let deadline = Instant::now() + Duration::from_micros(200);
        t.try_sleep_until(deadline).await.unwrap();
        assert!(Instant::now() >= deadline);
        t.try_sleep_until(Instant::now() - Duration::from_millis(1)).await.unwrap();
    }
}
