//! How late a software source's timers fire: the spread in time with which real hosts start
//! sending after a slice ends.
//!
//! Hardware boards share a clock and send in lockstep; the simulator does that by default.
//! Software sources (the testbed's `shoal node` processes, a farm's readout PCs) do not: a
//! tokio timer fires on the next tick of a 1 ms wheel counted from its own runtime's start,
//! so every process has its own constant phase, and the process then waits for a CPU, for
//! long when many wake at once on few cores. Without this spread every simulated source hits
//! a switch port in the same nanosecond and overflows buffers that real hosts do not
//! (docs/validation.md measures both).
//!
//! The model: a wake-up due at `t` happens at `t + phase[s] + jitter`, the phase drawn once
//! per source, uniform in `[0, phase_us)`, the jitter per wake-up, exponential with mean
//! `jitter_us`, or drawn from a measured distribution when one is given (the testbed's
//! lags are not exponential: on a quiet machine most wake-ups come within a narrow band,
//! and the band, not the mean, decides how many sources start sending together). Both
//! come from the scenario's seed.

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;
use shoal_core::Duration;
use shoal_core::loghist::LogHistogram;

/// The wake-up latency of every source host.
#[derive(Debug)]
pub struct WakeLatency {
    phases: Vec<Duration>,
    jitter_mean_us: f64,
    /// A measured distribution to draw the jitter from (non-empty), in place of the
    /// exponential.
    measured: Option<LogHistogram>,
    rng: Pcg64Mcg,
}

impl WakeLatency {
    pub fn new(
        n_sources: u32,
        phase_us: f64,
        jitter_us: f64,
        measured: Option<LogHistogram>,
        seed: u64,
    ) -> WakeLatency {
        // Its own stream, so turning the model on does not change the network's draws.
        let mut rng = Pcg64Mcg::seed_from_u64(seed ^ 0x5741_4b45_5550_u64);
        let phases =
            (0..n_sources).map(|_| Duration::from_nanos((rng.random::<f64>() * phase_us * 1e3) as u64)).collect();
        let measured = measured.filter(|h| !h.is_empty());
        WakeLatency { phases, jitter_mean_us: jitter_us, measured, rng }
    }

    /// Whether every wake-up is on time (hardware boards).
    pub fn is_zero(&self) -> bool {
        self.measured.is_none() && self.jitter_mean_us == 0.0 && self.phases.iter().all(|p| p.is_zero())
    }

    /// How late source `s` wakes this time.
    pub fn draw(&mut self, s: u32) -> Duration {
        let phase = self.phases.get(s as usize).copied().unwrap_or_default();
        if let Some(h) = &self.measured {
            let u: f64 = self.rng.random();
            return phase + Duration::from_nanos((h.inverse_cdf(u).unwrap_or(0.0) * 1e3) as u64);
        }
        if self.jitter_mean_us == 0.0 {
            return phase;
        }
        // Exponential by inversion; 1 - u is in (0, 1], so the logarithm is finite.
        let u: f64 = self.rng.random();
        phase + Duration::from_nanos((-(1.0 - u).ln() * self.jitter_mean_us * 1e3) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_latency_by_default() {
        let mut w = WakeLatency::new(4, 0.0, 0.0, None, 1);
        assert!(w.is_zero());
        assert_eq!(w.draw(3), Duration::ZERO);
    }

    #[test]
    fn phases_are_fixed_per_source_and_jitter_has_its_mean() {
        let mut w = WakeLatency::new(50, 1000.0, 0.0, None, 7);
        assert!(!w.is_zero());
        let first: Vec<_> = (0..50).map(|s| w.draw(s)).collect();
        assert!(first.iter().all(|p| *p < Duration::from_millis(1)));
        assert_eq!(first, (0..50).map(|s| w.draw(s)).collect::<Vec<_>>(), "a phase does not change");
        assert!(first.iter().collect::<std::collections::BTreeSet<_>>().len() > 40, "phases differ by source");

        let mut j = WakeLatency::new(1, 0.0, 2000.0, None, 7);
        let n = 20_000;
        let mean_us = (0..n).map(|_| j.draw(0).as_nanos() as f64 / 1e3).sum::<f64>() / n as f64;
        // The sample mean of 20,000 exponential draws is within 3% of 2 ms (about 4 sigma).
        assert!((mean_us - 2000.0).abs() < 60.0, "mean {mean_us} us");
    }

    #[test]
    fn a_measured_distribution_replaces_the_exponential() {
        // Lags in a narrow band, 300-340 µs, as a quiet machine's: the exponential of the
        // same mean would put a fifth of the wake-ups below 70 µs and one in a hundred past
        // 1.5 ms.
        let mut h = LogHistogram::default();
        for lag in (300..340).cycle().take(4_000) {
            h.record(lag);
        }
        let mut w = WakeLatency::new(1, 0.0, 320.0, Some(h), 7);
        assert!(!w.is_zero());
        let draws: Vec<f64> = (0..10_000).map(|_| w.draw(0).as_nanos() as f64 / 1e3).collect();
        // Within the recorded buckets (288-352 µs) every time.
        assert!(
            draws.iter().all(|&d| (288.0..352.0).contains(&d)),
            "{:?}",
            draws.iter().fold(f64::MAX, |a, &b| a.min(b))
        );
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 320.0).abs() < 10.0, "mean {mean}");
        // An empty histogram is no measurement: the exponential stays.
        let mut e = WakeLatency::new(1, 0.0, 320.0, Some(LogHistogram::default()), 7);
        assert!((0..1_000).any(|_| e.draw(0) < Duration::from_micros(70)));
    }
}
