//! shoal-detector: what the detector produces.
//!
//! - [`geometry::Geometry`]: modules (ANTARES floors, KM3NeT DOMs) and their PMTs, the
//!   ANTARES-like reference or read from a KM3NeT `.detx` file.
//! - [`physics::PhysicsGenerator`]: the realistic generator (K-40 singles and genuine
//!   coincidences, afterpulses, bioluminescence bursts, atmospheric muons with Cherenkov
//!   timing) with ground truth per hit.
//! - [`NoiseGenerator`]: uncorrelated Poisson singles only (the cheapest data source, for
//!   network benchmarks).
//! - [`workload`]: the fixed-size and burst-model workloads of the studies and the replay
//!   pool.
//! - [`Generator`]: any of them, as a source process or the simulator uses it
//!   (`source.generator`), behind shoal-core's [`shoal_core::node::Workload`] trait.
//!
//! Every generator is deterministic: the hits of (seed, source, slice) are the same
//! whatever order or process generates them. Payloads are the hit payload of
//! [`shoal_core::hit`].

pub mod geometry;
pub mod physics;
pub mod workload;

use bytes::{BufMut, BytesMut};
use rand::{Rng, RngExt, SeedableRng};
use rand_distr::{Distribution, Poisson};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};
use shoal_core::hit::{HIT_LEN, Hit, WAVEFORM_LEN, WAVEFORM_SAMPLES};
use shoal_core::node::Workload;
use shoal_core::{Duration, SourceId};

/// Background model of one source (front-end board).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NoiseConfig {
    /// Optical modules (PMT channels) per source. ANTARES: 3 per floor.
    pub oms: u8,
    /// Single-hit rate per optical module, Hz. ANTARES: about 70 kHz.
    pub rate_hz: f64,
    /// Waveform records per optical module per second (263 bytes each). 1650 Hz brings
    /// an ANTARES board to its nominal 3 MB/s (1.3 MB/s hits + about as much waveforms).
    pub waveform_rate_hz: f64,
    /// Seed of the run.
    pub seed: u64,
}

impl Default for NoiseConfig {
    fn default() -> Self {
        Self { oms: 3, rate_hz: 70_000.0, waveform_rate_hz: 1_650.0, seed: 1 }
    }
}

pub use shoal_core::node::GeneratedFragment;

/// Why a generator configuration is unusable.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("rate {0} Hz must be finite and non-negative")]
    BadRate(f64),
    #[error("at least one optical module per source")]
    NoModules,
    #[error("physics generator version {0} is unknown (1 or 2)")]
    UnknownVersion(u32),
}

/// Poisson background generator. See the crate documentation.
#[derive(Clone, Debug)]
pub struct NoiseGenerator {
    cfg: NoiseConfig,
    slice_ns: u32,
    hits_per_om: Option<Poisson<f64>>,
    waveforms_per_om: Option<Poisson<f64>>,
}

/// Appends one waveform record: channel, a random time, a pulse of 1-7 photo-electrons.
fn put_waveform(payload: &mut BytesMut, rng: &mut Pcg64Mcg, channel: u8, span: u32) {
    static PULSES: std::sync::OnceLock<Vec<[u8; WAVEFORM_SAMPLES]>> = std::sync::OnceLock::new();
    let pulses = PULSES.get_or_init(|| (0..8).map(pulse).collect());
    payload.put_u8(channel);
    payload.put_u32_le(rng.random_range(0..span));
    let amplitude = rng.random_range(1u8..8);
    payload.put_slice(&pulses[usize::from(amplitude)]);
}

/// Appends Poisson(`mean_per_channel`) waveform records for each of `channels`; returns how
/// many.
pub(crate) fn append_waveforms(
    payload: &mut BytesMut,
    rng: &mut Pcg64Mcg,
    channels: usize,
    mean_per_channel: f64,
    span: u32,
) -> u32 {
    let Some(p) = poisson(mean_per_channel) else { return 0 };
    let mut total = 0;
    for c in 0..channels {
        let n = p.sample(rng) as u32;
        for _ in 0..n {
            put_waveform(payload, rng, c as u8, span);
        }
        total += n;
    }
    total
}

/// A PMT pulse sampled at 1 GHz: baseline 20 counts, fast rise, exponential tail; `pe`
/// photo-electrons of 25 counts each, clipped at 255.
fn pulse(pe: u8) -> [u8; WAVEFORM_SAMPLES] {
    let mut s = [20u8; WAVEFORM_SAMPLES];
    for (i, v) in s.iter_mut().enumerate().skip(20) {
        let t = (i - 20) as f64;
        let shape = (1.0 - (-t / 2.0).exp()) * (-t / 12.0).exp();
        *v = (20.0 + f64::from(pe) * 25.0 * shape).min(255.0) as u8;
    }
    s
}

fn poisson(mean: f64) -> Option<Poisson<f64>> {
    // Poisson::new rejects a zero mean; zero means "none".
    (mean > 0.0).then(|| Poisson::new(mean).expect("finite positive mean"))
}

/// Stable LSD radix sort of packed hit keys by their time field (`key >> 16`, below
/// `span` <= 2^32), in passes of 8 bits whose counts are taken in one read: linear in the
/// number of hits, where a comparison sort of the ~2100 hits of an ANTARES fragment costs
/// several times more (and 12-bit passes spent more on their 4096 counters than on the
/// hits).
pub(crate) fn radix_sort_by_time(keys: &mut Vec<u64>, span: u32) {
    const BITS: u32 = 8;
    const BUCKETS: usize = 1 << BITS;
    let time_bits = 32 - span.saturating_sub(1).leading_zeros();
    let passes = time_bits.div_ceil(BITS) as usize;
    let mut counts = [[0usize; BUCKETS]; 4];
    for &k in keys.iter() {
        let t = k >> 16;
        for (p, c) in counts.iter_mut().enumerate().take(passes) {
            c[((t >> (BITS as usize * p)) as usize) & (BUCKETS - 1)] += 1;
        }
    }
    let mut tmp = vec![0u64; keys.len()];
    for (p, c) in counts.iter_mut().enumerate().take(passes) {
        let mut sum = 0;
        for n in c.iter_mut() {
            (*n, sum) = (sum, sum + *n);
        }
        let shift = 16 + BITS as usize * p;
        for &k in keys.iter() {
            let b = ((k >> shift) as usize) & (BUCKETS - 1);
            tmp[c[b]] = k;
            c[b] += 1;
        }
        std::mem::swap(keys, &mut tmp);
    }
}

/// A hit as the generators' sort key: time above channel above amplitude, so that the
/// low 16 bits can carry something else while sorting by time (`key >> 16`).
pub(crate) fn hit_key(time_ns: u64, channel: u64, amplitude: u8) -> u64 {
    (time_ns << 16) | (channel << 8) | u64::from(amplitude)
}

/// The hit of a key of [`hit_key`].
pub(crate) fn unpack_hit_key(k: u64) -> Hit {
    Hit { time_ns: (k >> 16) as u32, channel: (k >> 8) as u8, amplitude: k as u8 }
}

/// Appends the 6-byte records of time-sorted hit keys ([`hit_key`]).
pub(crate) fn put_hit_keys(payload: &mut BytesMut, keys: &[u64]) {
    let start = payload.len();
    payload.resize(start + keys.len() * HIT_LEN, 0);
    for (rec, &k) in payload[start..].chunks_exact_mut(HIT_LEN).zip(keys) {
        // channel, time (u32 LE), amplitude: the key's bytes 1, 2..6, 0.
        let r = (k >> 8) & 0xff | (k >> 16) << 8 | (k & 0xff) << 40;
        rec.copy_from_slice(&r.to_le_bytes()[..HIT_LEN]);
    }
}

/// Room for the waveforms of `channels` channels with `mean_per_channel` each, rarely
/// exceeded (four standard deviations).
pub(crate) fn expected_waveform_bytes(channels: usize, mean_per_channel: f64) -> usize {
    let mean = mean_per_channel * channels as f64;
    (mean + 4.0 * mean.sqrt()).ceil() as usize * WAVEFORM_LEN
}

/// SplitMix64 finaliser: decorrelates (seed, source, slice) into one RNG seed.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl NoiseGenerator {
    /// `slice` is the slice length (at most about 4.29 s: hit times are u32 ns).
    pub fn new(cfg: NoiseConfig, slice: Duration) -> Result<Self, ConfigError> {
        for r in [cfg.rate_hz, cfg.waveform_rate_hz] {
            if !r.is_finite() || r < 0.0 {
                return Err(ConfigError::BadRate(r));
            }
        }
        if cfg.oms == 0 {
            return Err(ConfigError::NoModules);
        }
        let slice_ns = u32::try_from(slice.as_nanos()).unwrap_or(u32::MAX);
        let secs = f64::from(slice_ns) * 1e-9;
        Ok(Self {
            hits_per_om: poisson(cfg.rate_hz * secs),
            waveforms_per_om: poisson(cfg.waveform_rate_hz * secs),
            cfg,
            slice_ns,
        })
    }

    pub fn config(&self) -> &NoiseConfig {
        &self.cfg
    }

    /// Mean payload bytes per fragment.
    pub fn mean_fragment_bytes(&self) -> f64 {
        let secs = f64::from(self.slice_ns) * 1e-9;
        f64::from(self.cfg.oms)
            * secs
            * (self.cfg.rate_hz * HIT_LEN as f64 + self.cfg.waveform_rate_hz * WAVEFORM_LEN as f64)
    }

    /// The data of `source` in slice `slice`, hits sorted by time.
    pub fn generate(&self, source: SourceId, slice: u64) -> GeneratedFragment {
        let mut rng = Pcg64Mcg::seed_from_u64(mix(self.cfg.seed ^ mix(u64::from(source) ^ mix(slice))));
        let span = self.slice_ns.max(1);
        // One 64-bit draw per hit: the high half picks the time (multiply-shift, unbiased to
        // 2^-32), the low half the amplitude (time over threshold around the single
        // photo-electron peak, 15..40 ns). Keys pack (time << 16 | channel << 8 | amp).
        let mut keys: Vec<u64> = Vec::new();
        let mut wave_counts = [0u32; 256];
        for channel in 0..self.cfg.oms {
            if let Some(p) = &self.hits_per_om {
                let n = p.sample(&mut rng) as usize;
                keys.reserve(n);
                for _ in 0..n {
                    let r = rng.next_u64();
                    let t = ((r >> 32) * u64::from(span)) >> 32;
                    let amp = 15 + (((r & 0xffff) * 25) >> 16);
                    keys.push(hit_key(t, u64::from(channel), amp as u8));
                }
            }
            if let Some(p) = &self.waveforms_per_om {
                wave_counts[channel as usize] = p.sample(&mut rng) as u32;
            }
        }
        radix_sort_by_time(&mut keys, span);
        let waveforms: u32 = wave_counts.iter().sum();
        let mut payload = BytesMut::with_capacity(keys.len() * HIT_LEN + waveforms as usize * WAVEFORM_LEN);
        put_hit_keys(&mut payload, &keys);
        for (channel, &n) in wave_counts.iter().enumerate().take(usize::from(self.cfg.oms)) {
            for _ in 0..n {
                put_waveform(&mut payload, &mut rng, channel as u8, span);
            }
        }
        GeneratedFragment {
            hit_count: keys.len() as u32,
            waveform_count: waveforms,
            payload: payload.freeze(),
            burst: false,
            opaque: false,
        }
    }
}

/// Which generator a source runs (`source.generator`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GeneratorKind {
    /// [`physics::PhysicsGenerator`] on the ANTARES-like geometry (one floor per source).
    #[default]
    Physics,
    /// [`NoiseGenerator`]: singles only.
    Noise,
    /// [`workload::FixedWorkload`]: the same fragment every slice (`source.fixed_bytes`).
    Fixed,
    /// [`workload::BurstWorkload`]: domain.md's burst model (`[source.bursts]`).
    Bursts,
}

impl GeneratorKind {
    pub const ALL: [GeneratorKind; 4] =
        [GeneratorKind::Physics, GeneratorKind::Noise, GeneratorKind::Fixed, GeneratorKind::Bursts];

    /// Whether a fragment costs real computing (simulated hits: milliseconds per slice,
    /// ten times more in a burst), as opposed to copying or sizing bytes.
    pub fn computes_hits(self) -> bool {
        matches!(self, GeneratorKind::Physics | GeneratorKind::Noise)
    }

    pub fn name(self) -> &'static str {
        match self {
            GeneratorKind::Physics => "physics",
            GeneratorKind::Noise => "noise",
            GeneratorKind::Fixed => "fixed",
            GeneratorKind::Bursts => "bursts",
        }
    }
}

impl std::str::FromStr for GeneratorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        GeneratorKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown generator {s:?} (physics, noise, fixed or bursts)"))
    }
}

/// A source's workload, any kind.
#[derive(Clone, Debug)]
pub enum Generator {
    Physics(Box<physics::PhysicsGenerator>),
    Noise(Box<NoiseGenerator>),
    Fixed(workload::FixedWorkload),
    Bursts(Box<workload::BurstWorkload>),
    Replay(workload::ReplayPool),
}

impl Generator {
    pub fn generate(&self, source: SourceId, slice: u64) -> GeneratedFragment {
        match self {
            Generator::Physics(g) => g.generate(source as usize, slice),
            Generator::Noise(g) => g.generate(source, slice),
            Generator::Fixed(g) => g.generate(source, slice),
            Generator::Bursts(g) => g.generate(source, slice),
            Generator::Replay(g) => g.generate(source, slice),
        }
    }

    /// `n` slices per source of `sources` generated now and replayed in turn.
    pub fn into_replay_pool(self, sources: &[SourceId], n: u32) -> Generator {
        Generator::Replay(workload::ReplayPool::new(&self, sources, n))
    }
}

impl Workload for Generator {
    fn generate(&self, source: SourceId, slice: u64) -> GeneratedFragment {
        Generator::generate(self, source, slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::hit::HitPayload;

    #[test]
    fn deterministic_sorted_and_at_the_right_rate() {
        let g = NoiseGenerator::new(NoiseConfig::default(), Duration::from_millis(10)).unwrap();
        let a = g.generate(3, 17);
        assert_eq!(a, g.generate(3, 17));
        assert_ne!(a.payload, g.generate(4, 17).payload);
        let p = HitPayload::parse(&a.payload, a.hit_count).unwrap();
        assert_eq!(p.waveform_count() as u32, a.waveform_count);
        let hits: Vec<_> = p.hits().collect();
        assert!(hits.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        assert!(hits.iter().all(|h| h.channel < 3 && h.time_ns < 10_000_000));
        // Mean over many slices: 3 OMs x 70 kHz x 10 ms = 2100 hits, Poisson sd ~46 per
        // slice, so the mean of 200 slices is within +-1% with overwhelming probability.
        let total: u64 = (0..200).map(|s| u64::from(g.generate(0, s).hit_count)).sum();
        let mean = total as f64 / 200.0;
        assert!((mean - 2100.0).abs() < 21.0, "mean {mean}");
    }

    /// The same (seed, source, slice) gives the same bytes in every version; the digest was
    /// taken before the generators were made faster (issue 32, goal 5).
    #[test]
    fn the_bytes_of_a_seed_do_not_change() {
        let g = NoiseGenerator::new(NoiseConfig::default(), Duration::from_millis(10)).unwrap();
        let digest =
            (0..40).flat_map(|slice| (0..30).map(move |source| (source, slice))).fold(0, |crc, (source, slice)| {
                shoal_core::checksum::crc32c_append(crc, &g.generate(source, slice).payload)
            });
        assert_eq!(digest, 422_543_506);
    }

    #[test]
    fn radix_sort_sorts_by_time_stably() {
        let keys: Vec<u64> = [(5u64, 1u64), (3, 2), (5, 0), (9_999_999, 3), (0, 4), (3, 1)]
            .iter()
            .map(|&(t, tag)| t << 16 | tag)
            .collect();
        let mut sorted = keys;
        radix_sort_by_time(&mut sorted, 10_000_000);
        let got: Vec<(u64, u64)> = sorted.iter().map(|k| (k >> 16, k & 0xffff)).collect();
        assert_eq!(got, [(0, 4), (3, 2), (3, 1), (5, 1), (5, 0), (9_999_999, 3)]);
    }

    #[test]
    fn rejects_bad_config() {
        let cfg = NoiseConfig { rate_hz: f64::NAN, ..Default::default() };
        assert!(NoiseGenerator::new(cfg, Duration::from_millis(10)).is_err());
        let cfg = NoiseConfig { oms: 0, ..Default::default() };
        assert!(NoiseGenerator::new(cfg, Duration::from_millis(10)).is_err());
        let cfg = NoiseConfig { rate_hz: 0.0, waveform_rate_hz: 0.0, ..Default::default() };
        assert_eq!(NoiseGenerator::new(cfg, Duration::from_millis(10)).unwrap().generate(0, 0).hit_count, 0);
    }
}
