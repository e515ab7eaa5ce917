//! Reports shared by every role: delay histograms and their statistics in microseconds.
//!
//! Below the roles, so that a builder's report, a node's record of it and the demo's
//! summary speak of delays in the same types.

use hdrhistogram::Histogram;
use shoal_core::loghist::LogHistogram;

/// Delay histograms are kept in microseconds, up to one hour.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

/// A histogram as its recorded values, `[value, count]`, lowest first: what
/// [`Histogram::record_n`] takes back (a run's builders pooled exactly).
pub fn recorded_counts(h: &Histogram<u64>) -> Vec<[u64; 2]> {
    h.iter_recorded().map(|v| [v.value_iterated_to(), v.count_at_value()]).collect()
}

/// Delay statistics in microseconds.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DelayStats {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl DelayStats {
    /// From a [`LogHistogram`] (to a bucket's width, 12.5 %; the maximum is its bucket's
    /// upper bound).
    pub fn from_log(h: &LogHistogram) -> Self {
        let quantile = |u: f64| h.inverse_cdf(u).unwrap_or(0.0).round() as u64;
        Self {
            count: h.count(),
            mean_us: h.mean().unwrap_or(0.0),
            p50_us: quantile(0.5),
            p99_us: quantile(0.99),
            max_us: quantile(1.0),
        }
    }

    pub fn from_histogram(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            mean_us: h.mean(),
            p50_us: h.value_at_quantile(0.5),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        }
    }
}
