//! The workloads a source can run, behind shoal-core's [`Workload`] trait, so that the
//! runtime and the simulator run the same data:
//!
//! - [`FixedWorkload`]: the studies' constant fragment (e.g. 30,000 bytes on the wire);
//! - [`BurstWorkload`]: domain.md's burst model (25,000 bytes normally, 150,000 during a
//!   bioluminescence burst, bursts 5% of the time, lengths uniform up to 3 s);
//! - [`Generator`](crate::Generator): the noise and physics generators;
//! - [`ReplayPool`]: a few slices generated once per source and replayed in turn, so a
//!   benchmark of the network path is not limited by the random generator.
//!
//! Fixed and burst payloads are valid hit payloads (hit records, then whole waveform
//! records) built once and shared by reference count: producing one costs nothing.

use std::collections::HashMap;

use bytes::BytesMut;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Poisson};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};
use shoal_core::frame::HEADER_LEN;
use shoal_core::hit::{HIT_LEN, Hit, WAVEFORM_LEN};
use shoal_core::node::{GeneratedFragment, Workload};
use shoal_core::slice::SliceNumber;
use shoal_core::{Duration, SourceId};

use crate::{ConfigError, mix};

/// A fixed payload that makes a frame of exactly `wire_bytes` on the wire (header
/// included) where that is possible: hit records plus 0 to 5 waveform records fill any
/// payload of at least 5 waveforms; smaller ones are rounded down to whole hits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FixedPayload {
    fragment: GeneratedFragment,
}

impl FixedPayload {
    pub fn new(wire_bytes: u32, slice: Duration) -> Self {
        let payload_len = (wire_bytes as usize).saturating_sub(HEADER_LEN);
        // 263 = 5 (mod 6) is invertible mod 6: some w in 0..6 makes the rest whole hits.
        let waveforms = (0..6usize)
            .find(|&w| w * WAVEFORM_LEN <= payload_len && (payload_len - w * WAVEFORM_LEN).is_multiple_of(HIT_LEN))
            .unwrap_or(0);
        let hits = (payload_len - waveforms * WAVEFORM_LEN) / HIT_LEN;
        let span = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX).clamp(1, u64::from(u32::MAX));
        let mut buf = BytesMut::zeroed(hits * HIT_LEN + waveforms * WAVEFORM_LEN);
        for (i, rec) in buf[..hits * HIT_LEN].chunks_exact_mut(HIT_LEN).enumerate() {
            let time_ns = (i as u64 * span / hits.max(1) as u64) as u32;
            Hit { time_ns, channel: (i % 3) as u8, amplitude: 27 }.write_record(rec);
        }
        Self {
            fragment: GeneratedFragment {
                hit_count: hits as u32,
                waveform_count: waveforms as u32,
                payload: buf.freeze(),
                burst: false,
                opaque: false,
            },
        }
    }

    /// Length of the frame on the wire.
    pub fn wire_bytes(&self) -> u64 {
        (HEADER_LEN + self.fragment.payload.len()) as u64
    }

    fn fragment(&self, burst: bool) -> GeneratedFragment {
        GeneratedFragment { burst, ..self.fragment.clone() }
    }
}

/// Every source sends the same fragment every slice (`source.generator = "fixed"`).
#[derive(Clone, Debug)]
pub struct FixedWorkload {
    payload: FixedPayload,
}

impl FixedWorkload {
    pub fn new(wire_bytes: u32, slice: Duration) -> Self {
        Self { payload: FixedPayload::new(wire_bytes, slice) }
    }
    pub fn wire_bytes(&self) -> u64 {
        self.payload.wire_bytes()
    }
}

impl Workload for FixedWorkload {
    fn generate(&self, _source: SourceId, _slice: SliceNumber) -> GeneratedFragment {
        self.payload.fragment(false)
    }
}

/// The burst model's parameters (the `[source.bursts]` table; domain.md section 2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BurstConfig {
    /// Fraction of the time a board is in a burst.
    pub fraction: f64,
    /// Burst lengths are uniform in [0, max_s].
    pub max_s: f64,
    /// Fragment size on the wire outside bursts, bytes.
    pub base_bytes: u32,
    /// Fragment size on the wire during a burst, bytes.
    pub burst_bytes: u32,
    pub seed: u64,
}

impl Default for BurstConfig {
    fn default() -> Self {
        Self { fraction: 0.05, max_s: 3.0, base_bytes: 25_000, burst_bytes: 150_000, seed: 1 }
    }
}

/// When each board is in a bioluminescence burst: a pure function of (seed, board, slice).
///
/// Bursts start as a Poisson process per board, drawn per 10-second window, so that a
/// burst spanning slices (and windows) is seen consistently by every slice it covers and by
/// every process that asks; the rate is set so the board is in a burst `fraction` of the
/// time (mean gap = mean length x (1 - f) / f).
#[derive(Clone, Debug)]
pub struct BurstSchedule {
    seed: u64,
    max_s: f64,
    slice_s: f64,
    starts_per_window: Option<Poisson<f64>>,
}

const BURST_WINDOW_S: f64 = 10.0;

impl BurstSchedule {
    pub fn new(seed: u64, fraction: f64, max_s: f64, slice: Duration) -> Result<Self, ConfigError> {
        if !(0.0..1.0).contains(&fraction) {
            return Err(ConfigError::BadRate(fraction));
        }
        if !(max_s.is_finite() && max_s > 0.0) {
            return Err(ConfigError::BadRate(max_s));
        }
        let per_window = fraction / (1.0 - fraction) * BURST_WINDOW_S / (max_s / 2.0);
        let starts_per_window = (per_window > 0.0).then(|| Poisson::new(per_window).expect("positive mean"));
        Ok(Self { seed, max_s, slice_s: slice.as_secs_f64(), starts_per_window })
    }

    /// Whether `board` is in a burst during `slice` (at its middle).
    pub fn in_burst(&self, board: u64, slice: SliceNumber) -> bool {
        let Some(poisson) = &self.starts_per_window else { return false };
        let t = (slice as f64 + 0.5) * self.slice_s;
        let w = (t / BURST_WINDOW_S).floor() as u64;
        // Bursts starting in this window or the few before it may cover t.
        let reach = (self.max_s / BURST_WINDOW_S).ceil() as u64;
        (w.saturating_sub(reach)..=w).any(|win| {
            let mut rng = Pcg64Mcg::seed_from_u64(mix(self.seed ^ 0x6269_6f6c ^ mix(board ^ mix(win))));
            let n = poisson.sample(&mut rng) as u32;
            (0..n).any(|_| {
                let start = (win as f64 + rng.random::<f64>()) * BURST_WINDOW_S;
                let len = rng.random::<f64>() * self.max_s;
                t >= start && t < start + len
            })
        })
    }
}

/// domain.md's burst model (`source.generator = "bursts"`).
#[derive(Clone, Debug)]
pub struct BurstWorkload {
    schedule: BurstSchedule,
    base: FixedPayload,
    burst: FixedPayload,
}

impl BurstWorkload {
    pub fn new(cfg: &BurstConfig, slice: Duration) -> Result<Self, ConfigError> {
        Ok(Self {
            schedule: BurstSchedule::new(cfg.seed, cfg.fraction, cfg.max_s, slice)?,
            base: FixedPayload::new(cfg.base_bytes, slice),
            burst: FixedPayload::new(cfg.burst_bytes, slice),
        })
    }
}

impl Workload for BurstWorkload {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        if self.schedule.in_burst(u64::from(source), slice) {
            self.burst.fragment(true)
        } else {
            self.base.fragment(false)
        }
    }
}

/// `n` slices per source generated once and replayed in turn (same bytes, new slice
/// numbers; `source.replay_pool`).
#[derive(Clone, Debug)]
pub struct ReplayPool {
    pool: HashMap<SourceId, Vec<GeneratedFragment>>,
}

impl ReplayPool {
    pub fn new<W: Workload + ?Sized>(inner: &W, sources: &[SourceId], n: u32) -> Self {
        let pool =
            sources.iter().map(|&id| (id, (0..u64::from(n.max(1))).map(|s| inner.generate(id, s)).collect())).collect();
        Self { pool }
    }
}

impl Workload for ReplayPool {
    /// Sources outside the pool get empty fragments.
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        match self.pool.get(&source) {
            Some(frags) => frags[(slice % frags.len() as u64) as usize].clone(),
            None => GeneratedFragment::empty(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::hit::HitPayload;

    const SLICE: Duration = Duration::from_millis(10);

    #[test]
    fn fixed_fragments_have_the_exact_wire_size_and_parse() {
        for wire in [30_000u32, 25_000, 150_000, 1_371, 64_000, 1_000_000] {
            let w = FixedWorkload::new(wire, SLICE);
            assert_eq!(w.wire_bytes(), u64::from(wire), "{wire}");
            let f = w.generate(3, 9);
            let p = HitPayload::parse(&f.payload, f.hit_count).unwrap();
            assert_eq!(p.waveform_count() as u32, f.waveform_count);
            assert!(p.hits().all(|h| h.time_ns < 10_000_000));
        }
        // Too small for the waveform trick: whole hits, rounded down.
        assert_eq!(FixedWorkload::new(100, SLICE).wire_bytes(), 56 + 42);
        assert_eq!(FixedWorkload::new(10, SLICE).wire_bytes(), 56);
    }

    #[test]
    fn bursts_cover_about_the_configured_fraction() {
        let w = BurstWorkload::new(&BurstConfig::default(), SLICE).unwrap();
        let (boards, slices) = (50u32, 20_000u64);
        let mut burst = 0u64;
        for b in 0..boards {
            for s in 0..slices {
                let f = w.generate(b, s);
                assert_eq!(f.burst, f.payload.len() + HEADER_LEN == 150_000);
                burst += u64::from(f.burst);
            }
        }
        // 50 boards x 200 s: about 3,300 bursts of mean 1.5 s; the fraction is 5% within
        // a few tenths of a percent.
        let frac = burst as f64 / (f64::from(boards) * slices as f64);
        assert!((0.04..0.06).contains(&frac), "burst fraction {frac}");
        assert_eq!(w.generate(7, 1234), w.generate(7, 1234), "deterministic");
    }

    #[test]
    fn replay_pool_repeats_per_source() {
        let w = BurstWorkload::new(&BurstConfig { fraction: 0.5, ..Default::default() }, SLICE).unwrap();
        let pool = ReplayPool::new(&w, &[0, 1], 3);
        assert_eq!(pool.generate(1, 4), w.generate(1, 1));
        assert_eq!(pool.generate(5, 4), GeneratedFragment::empty());
    }
}
