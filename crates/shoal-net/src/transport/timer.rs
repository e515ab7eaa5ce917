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
//!
//! A source's loop waits on the timer and on its links' reports at once, so most waits are
//! dropped before the timer fires and the next one asks for the same deadline: the timer
//! stays armed for it, and is armed again only for another deadline (arming, and the reads
//! that clear an expiry forgotten by re-arming, were four of the seven system calls a
//! fragment cost: docs/benchmarks.md "Cost per fragment").

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::Instant;

use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// One re-armable timer (a `timerfd`); one per task that waits on it.
#[derive(Debug)]
pub struct FineTimer {
    fd: AsyncFd<OwnedFd>,
    /// The deadline the timer is armed for and whose expiry has not been read yet.
    armed: Mutex<Option<Instant>>,
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
        Ok(Self { fd, armed: Mutex::new(None) })
    }

    /// Waits until `deadline`. Cancel-safe: a wait dropped half-way leaves the timer armed;
    /// the next call for the same deadline waits on that arming (ending at once if it
    /// fired meanwhile), one for another deadline arms it afresh (which also forgets an
    /// expiry not yet read). Should the timer fail, the wait is tokio's (never a busy
    /// loop).
    pub async fn sleep_until(&self, deadline: Instant) {
        if self.try_sleep_until(deadline).await.is_err() {
            tokio::time::sleep_until(deadline.into()).await;
        }
    }

    async fn try_sleep_until(&self, deadline: Instant) -> io::Result<()> {
        let Some(wait) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Ok(());
        };
        let armed = *self.armed.lock().unwrap_or_else(|e| e.into_inner());
        if armed != Some(deadline) {
            let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
            let value = Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
            // Forgotten first: should arming fail, no later call trusts it.
            *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = None;
            rustix::time::timerfd_settime(
                self.fd.get_ref(),
                TimerfdTimerFlags::empty(),
                &Itimerspec { it_interval: zero, it_value: value },
            )?;
            *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(deadline);
        }
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expirations = [0u8; 8];
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(Ok(_)) => {
                    // The read took every expiry of this one-shot arming: nothing is
                    // readable until the next arming fires, so the next wait need not
                    // find that out with a read of its own.
                    ready.clear_ready();
                    *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    return Ok(());
                }
                Ok(Err(e)) => {
                    *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    return Err(e);
                }
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

    #[tokio::test]
    async fn a_wait_dropped_and_asked_again_for_the_same_deadline_ends_at_that_deadline() {
        let t = FineTimer::new().unwrap();
        let deadline = Instant::now() + Duration::from_millis(20);
        // Dropped early (most likely; on a stalled machine it may have ended: either way
        // the next wait for the same deadline must end, and not before it).
        let _ = tokio::time::timeout(Duration::from_micros(100), t.try_sleep_until(deadline)).await;
        t.try_sleep_until(deadline).await.unwrap();
        assert!(Instant::now() >= deadline, "woke before its deadline");
        // The expiry was read: a wait for the same, now past, deadline returns at once and
        // a later one is armed afresh.
        t.try_sleep_until(deadline).await.unwrap();
        let later = Instant::now() + Duration::from_micros(500);
        t.try_sleep_until(later).await.unwrap();
        assert!(Instant::now() >= later);
    }
}
