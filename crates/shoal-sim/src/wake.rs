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
//! `jitter_us`. Both come from the scenario's seed.

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;
use shoal_core::Duration;

/// The wake-up latency of every source host.
#[derive(Debug)]
pub struct WakeLatency {
    phases: Vec<Duration>,
    jitter_mean_us: f64,
    rng: Pcg64Mcg,
}

impl WakeLatency {
    pub fn new(n_sources: u32, phase_us: f64, jitter_us: f64, seed: u64) -> WakeLatency {
        // Its own stream, so turning the model on does not change the network's draws.
        let mut rng = Pcg64Mcg::seed_from_u64(seed ^ 0x5741_4b45_5550_u64);
        let phases =
            (0..n_sources).map(|_| Duration::from_nanos((rng.random::<f64>() * phase_us * 1e3) as u64)).collect();
        WakeLatency { phases, jitter_mean_us: jitter_us, rng }
    }

    /// Whether every wake-up is on time (hardware boards).
    pub fn is_zero(&self) -> bool {
        self.jitter_mean_us == 0.0 && self.phases.iter().all(|p| p.is_zero())
    }

    /// How late source `s` wakes this time.
    pub fn draw(&mut self, s: u32) -> Duration {
        let phase = self.phases.get(s as usize).copied().unwrap_or_default();
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
        let mut w = WakeLatency::new(4, 0.0, 0.0, 1);
        assert!(w.is_zero());
        assert_eq!(w.draw(3), Duration::ZERO);
    }

    #[test]
    fn phases_are_fixed_per_source_and_jitter_has_its_mean() {
        let mut w = WakeLatency::new(50, 1000.0, 0.0, 7);
        assert!(!w.is_zero());
        let first: Vec<_> = (0..50).map(|s| w.draw(s)).collect();
        assert!(first.iter().all(|p| *p < Duration::from_millis(1)));
        assert_eq!(first, (0..50).map(|s| w.draw(s)).collect::<Vec<_>>(), "a phase does not change");
        assert!(first.iter().collect::<std::collections::BTreeSet<_>>().len() > 40, "phases differ by source");

        let mut j = WakeLatency::new(1, 0.0, 2000.0, 7);
        let n = 20_000;
        let mean_us = (0..n).map(|_| j.draw(0).as_nanos() as f64 / 1e3).sum::<f64>() / n as f64;
        // The sample mean of 20,000 exponential draws is within 3% of 2 ms (about 4 sigma).
        assert!((mean_us - 2000.0).abs() < 60.0, "mean {mean_us} us");
    }
}
