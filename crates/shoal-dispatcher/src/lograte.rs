//! Repeated warnings said once and then at most once per interval, with a count of what
//! was held back: a source process with thousands of links must not print thousands of
//! identical lines when a builder goes away (issue 16).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One call site's limiter; keep it in a `static`.
#[derive(Debug)]
pub struct LogRate {
    every: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    last: Option<Instant>,
    held: u64,
}

impl LogRate {
    pub const fn new(every: Duration) -> LogRate {
        LogRate { every, state: Mutex::new(State { last: None, held: 0 }) }
    }

    /// Whether to say the line at `now`, and how many were held back since the last one
    /// said; `None`: hold this one back too.
    pub fn check_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.last {
            Some(t) if now.saturating_duration_since(t) < self.every => {
                s.held += 1;
                None
            }
            _ => {
                s.last = Some(now);
                Some(std::mem::take(&mut s.held))
            }
        }
    }

    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_is_said_then_one_per_interval_with_the_count_held_back() {
        let r = LogRate::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(r.check_at(t0), Some(0));
        for i in 1..=500 {
            assert_eq!(r.check_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(r.check_at(t0 + Duration::from_secs(10)), Some(500));
        assert_eq!(r.check_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(r.check_at(t0 + Duration::from_secs(25)), Some(1));
    }
}
