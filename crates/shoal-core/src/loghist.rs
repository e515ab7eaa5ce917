//! A small log-linear histogram of durations: how a distribution's shape travels from a
//! measurement (a source node's wake-up lag after each slice end) to a model drawing from
//! it (the simulator's software hosts).
//!
//! Values are microseconds. Below [`LogHistogram::SUB`] each value has its own bucket;
//! above, every power of two is cut into `SUB` equal buckets, so a bucket is at most
//! 1/`SUB` of its values wide (12.5 %). Buckets are counted in a `Vec` only as far as the
//! largest value recorded, so a report of lags up to a few milliseconds is about 80 numbers.
//! Two histograms add bucket by bucket ([`LogHistogram::merge`]): a run's sources pooled.

/// Counts of values (µs) in log-linear buckets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct LogHistogram {
    counts: Vec<u64>,
}

impl LogHistogram {
    /// Buckets per power of two (and the values below it, one bucket each).
    pub const SUB: u64 = 8;
    const SUB_BITS: u32 = Self::SUB.trailing_zeros();

    /// The bucket of `value`.
    fn index(value: u64) -> usize {
        if value < Self::SUB {
            return value as usize;
        }
        let octave = 63 - value.leading_zeros(); // >= SUB_BITS
        let shift = octave - Self::SUB_BITS;
        let mantissa = (value >> shift) - Self::SUB; // 0..SUB
        (Self::SUB * u64::from(shift + 1) + mantissa) as usize
    }

    /// The values of bucket `i`: `[low, high)`.
    pub fn bounds(i: usize) -> (u64, u64) {
        let i = i as u64;
        if i < Self::SUB {
            return (i, i + 1);
        }
        let shift = i / Self::SUB - 1;
        let mantissa = i % Self::SUB + Self::SUB;
        (mantissa << shift, (mantissa + 1) << shift)
    }

    pub fn record(&mut self, value_us: u64) {
        let i = Self::index(value_us);
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &LogHistogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    /// The value below which a fraction `u` (0 to 1) of the recorded values lie, spread
    /// evenly within its bucket: the inverse of the histogram's distribution function.
    /// A uniform `u` gives draws with the recorded distribution (to a bucket's width).
    /// `None` when nothing was recorded.
    pub fn inverse_cdf(&self, u: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let target = u.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            if (below + c) as f64 >= target {
                let (low, high) = Self::bounds(i);
                let within = ((target - below as f64) / c as f64).clamp(0.0, 1.0);
                return Some(low as f64 + within * (high - low) as f64);
            }
            below += c;
        }
        let (_, high) = Self::bounds(self.counts.len() - 1);
        Some(high as f64)
    }

    /// The mean, each value taken at its bucket's middle.
    pub fn mean(&self) -> Option<f64> {
        let total = self.count();
        (total > 0).then(|| {
            let sum: f64 = self
                .counts
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    let (low, high) = Self::bounds(i);
                    c as f64 * (low + high) as f64 / 2.0
                })
                .sum();
            sum / total as f64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_falls_in_its_bucket_and_buckets_tile_the_line() {
        for v in (0..5_000).chain([65_535, 65_536, 1 << 40, u64::MAX >> 1]) {
            let (low, high) = LogHistogram::bounds(LogHistogram::index(v));
            assert!(low <= v && v < high, "{v} in [{low}, {high})");
            assert!((high - low) as f64 <= (low.max(1) as f64 / 8.0).max(1.0), "{v}: [{low}, {high}) too wide");
        }
        for i in 0..300 {
            assert_eq!(LogHistogram::bounds(i).1, LogHistogram::bounds(i + 1).0, "bucket {i} and the next");
        }
    }

    #[test]
    fn draws_follow_the_recorded_distribution_and_merging_pools() {
        let (mut a, mut b) = (LogHistogram::default(), LogHistogram::default());
        assert_eq!(a.inverse_cdf(0.5), None);
        // 90 values at 100 µs, 10 at 5,000 µs, recorded by two sources.
        for _ in 0..90 {
            a.record(100);
        }
        for _ in 0..10 {
            b.record(5_000);
        }
        a.merge(&b);
        assert_eq!(a.count(), 100);
        let at = |u: f64| a.inverse_cdf(u).unwrap();
        assert!((96.0..104.0).contains(&at(0.5)), "{}", at(0.5));
        assert!((96.0..104.0).contains(&at(0.89)), "{}", at(0.89));
        assert!((4_608.0..5_120.0).contains(&at(0.95)), "{}", at(0.95));
        assert!(at(0.0) <= at(0.3) && at(0.3) <= at(0.95) && at(0.95) <= at(1.0));
        let mean = a.mean().unwrap();
        // Each value at its bucket's middle: 100 and 4,864.
        assert!((576.0..577.0).contains(&mean), "{mean}");
    }
}
