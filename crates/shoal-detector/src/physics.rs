//! The physics generator (physics.md section 1): K-40 singles, genuine K-40 coincidences,
//! afterpulses, bioluminescence bursts and atmospheric muons with Cherenkov timing, with
//! ground truth per hit, deterministic per seed.
//!
//! Everything is a pure function of (seed, module, slice) except the muons, which are a
//! function of (seed, slice) shared by all modules: each source computes the light of the
//! slice's muons on its own PMTs only, so sources in different processes agree without
//! talking. Bursts are drawn per (seed, module, 10-second window), so a burst spanning
//! slices (and windows) is seen consistently by every slice it covers.

use bytes::BytesMut;
use rand::{Rng, RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, Exp1, Normal, Poisson};
use rand_pcg::Pcg64Mcg;
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};
use shoal_core::hit::{HIT_LEN, Hit};

use crate::geometry::{Geometry, Module};
use crate::workload::BurstSchedule;
use crate::{ConfigError, GeneratedFragment, hit_key, mix, radix_sort_by_time, unpack_hit_key};

/// Speed of light in vacuum, m/ns.
pub const C_LIGHT: f64 = 0.299_792_458;
/// Phase refractive index of sea water.
pub const N_WATER: f64 = 1.38;
/// Cherenkov angle in sea water (cos = 1/n), radians.
pub fn cherenkov_angle() -> f64 {
    (1.0 / N_WATER).acos()
}

/// How the amplitude byte of a hit encodes the light it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AmplitudeKind {
    /// ANTARES: charge, 10 counts per photo-electron.
    Charge,
    /// KM3NeT: time over threshold in ns (single photo-electron peak near 27 ns).
    Tot,
}

/// Parameters of [`PhysicsGenerator`] (the `[source.physics]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PhysicsConfig {
    /// K-40 single-hit rate per PMT, Hz (ANTARES about 70 kHz, KM3NeT about 5-12 kHz).
    pub singles_hz: f64,
    /// Genuine K-40 coincidences per module, Hz (one decay lighting 2-3 PMTs within a few ns).
    pub coincidence_hz: f64,
    /// Spread of a genuine coincidence's hit times, ns (sd).
    pub coincidence_sigma_ns: f64,
    /// Probability that a hit is followed by an afterpulse 8-25 ns later on the same PMT.
    pub afterpulse_probability: f64,
    /// Fraction of the time a module is in a bioluminescence burst (domain.md: 5%).
    pub burst_fraction: f64,
    /// Longest burst, seconds (lengths uniform up to this).
    pub burst_max_s: f64,
    /// Singles rate multiplier during a burst.
    pub burst_rate_factor: f64,
    /// Atmospheric muons crossing the generation disk, Hz.
    pub muon_rate_hz: f64,
    /// Expected photo-electrons at 1 m from the track, head-on (scales with exp(-d/L)/d).
    pub muon_yield_pe: f64,
    /// Light attenuation length, m.
    pub attenuation_m: f64,
    /// PMT transit-time spread, ns (sd).
    pub jitter_ns: f64,
    /// Extra radius around the detector for muon starting points, m.
    pub muon_margin_m: f64,
    pub amplitude: AmplitudeKind,
    /// Waveform records per PMT per second (263 bytes each; 0: none).
    pub waveform_hz: f64,
    pub seed: u64,
    /// The generator's algorithm ([`PHYSICS_VERSIONS`]): the same (seed, module, slice)
    /// gives the same bytes within a version, other bytes of the same distributions in
    /// another.
    pub version: u32,
}

/// The physics generator's versions: 1 draws the hits PMT by PMT and sorts them by time
/// (up to 2026-11-28); 2, the default, draws them in time order (about 1.5 times as fast).
pub const PHYSICS_VERSIONS: [u32; 2] = [1, 2];

impl Default for PhysicsConfig {
    fn default() -> Self {
        Self {
            singles_hz: 70_000.0,
            coincidence_hz: 15.0,
            coincidence_sigma_ns: 2.0,
            afterpulse_probability: 0.02,
            burst_fraction: 0.05,
            burst_max_s: 3.0,
            burst_rate_factor: 6.0,
            muon_rate_hz: 10.0,
            muon_yield_pe: 100.0,
            attenuation_m: 55.0,
            jitter_ns: 1.3,
            muon_margin_m: 60.0,
            amplitude: AmplitudeKind::Charge,
            waveform_hz: 1_650.0,
            seed: 1,
            version: 2,
        }
    }
}

impl PhysicsConfig {
    /// The KM3NeT/ARCA flavour: small PMTs, about 7 kHz each, ToT amplitudes, a DOM-wide
    /// genuine-coincidence rate of some hundreds of Hz.
    pub fn km3net() -> Self {
        Self {
            singles_hz: 7_000.0,
            coincidence_hz: 600.0,
            muon_yield_pe: 30.0,
            amplitude: AmplitudeKind::Tot,
            waveform_hz: 0.0,
            ..Self::default()
        }
    }
}

/// An atmospheric muon: a straight track through `point` at time `t_ns` (ns since the
/// slice start) along the unit vector `dir`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Muon {
    /// Index of the muon within its slice.
    pub id: u32,
    pub point: [f64; 3],
    pub dir: [f64; 3],
    pub t_ns: f64,
}

/// A muon's identity: the slice it was generated in and its index there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MuonId {
    pub slice: u64,
    pub index: u32,
}

/// Where a hit came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Singles,
    Coincidence,
    Afterpulse,
    /// Cherenkov light of a muon (possibly one of a neighbouring slice near the boundary).
    Muon(MuonId),
}

/// One slice of one module with its ground truth.
#[derive(Clone, Debug)]
pub struct TruthFragment {
    pub fragment: GeneratedFragment,
    /// Hits in payload order (sorted by time) and their origin.
    pub hits: Vec<Hit>,
    pub origins: Vec<Origin>,
}

/// See the module documentation.
#[derive(Clone, Debug)]
pub struct PhysicsGenerator {
    cfg: PhysicsConfig,
    geometry: Geometry,
    slice_ns: u32,
    centre: [f64; 3],
    gen_radius: f64,
    tan_c: f64,
    sin_c: f64,
    /// Single photo-electron amplitudes, drawn once: a hit picks one with 10 random bits
    /// (a normal draw per hit cost most of the generator's time).
    spe_amplitudes: Vec<u8>,
    bursts: BurstSchedule,
}

/// The amplitude of `pe` photo-electrons (charge: 10 counts per p.e., 30% spread; ToT:
/// logarithmic around the 27 ns single-p.e. peak).
fn amplitude(kind: AmplitudeKind, rng: &mut Pcg64Mcg, pe: u32) -> u8 {
    let g: f64 = Normal::new(0.0, 1.0).expect("valid").sample(rng);
    let v = match kind {
        AmplitudeKind::Charge => 10.0 * f64::from(pe) * (1.0 + 0.3 * g),
        AmplitudeKind::Tot => 27.0 + 12.0 * f64::from(pe).ln() + 4.0 * g,
    };
    v.round().clamp(1.0, 255.0) as u8
}

fn sub(a: [f64; 3], b: [f64; 3]) -> [f64; 3] {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2]]
}
fn dot(a: [f64; 3], b: [f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}
fn norm(a: [f64; 3]) -> f64 {
    dot(a, a).sqrt()
}

impl PhysicsGenerator {
    pub fn new(cfg: PhysicsConfig, geometry: Geometry, slice: core::time::Duration) -> Result<Self, ConfigError> {
        for r in [
            cfg.singles_hz,
            cfg.coincidence_hz,
            cfg.muon_rate_hz,
            cfg.muon_yield_pe,
            cfg.waveform_hz,
            cfg.burst_rate_factor,
            cfg.jitter_ns,
            cfg.coincidence_sigma_ns,
        ] {
            if !r.is_finite() || r < 0.0 {
                return Err(ConfigError::BadRate(r));
            }
        }
        for p in [cfg.afterpulse_probability, cfg.burst_fraction] {
            if !(0.0..1.0).contains(&p) {
                return Err(ConfigError::BadRate(p));
            }
        }
        if !(cfg.attenuation_m > 0.0 && cfg.burst_max_s > 0.0) {
            return Err(ConfigError::BadRate(cfg.attenuation_m.min(cfg.burst_max_s)));
        }
        if geometry.modules.is_empty() {
            return Err(ConfigError::NoModules);
        }
        if !PHYSICS_VERSIONS.contains(&cfg.version) {
            return Err(ConfigError::UnknownVersion(cfg.version));
        }
        let (centre, radius) = geometry.bounding_sphere();
        let theta = cherenkov_angle();
        let mut table_rng = Pcg64Mcg::seed_from_u64(mix(cfg.seed ^ 0x7370_6521));
        let spe_amplitudes = (0..1024).map(|_| amplitude(cfg.amplitude, &mut table_rng, 1)).collect();
        let slice_ns = u32::try_from(slice.as_nanos()).unwrap_or(u32::MAX);
        let bursts = BurstSchedule::new(
            cfg.seed,
            cfg.burst_fraction,
            cfg.burst_max_s,
            core::time::Duration::from_nanos(u64::from(slice_ns)),
        )?;
        Ok(Self {
            spe_amplitudes,
            bursts,
            slice_ns,
            gen_radius: radius + cfg.muon_margin_m,
            centre,
            tan_c: theta.tan(),
            sin_c: theta.sin(),
            cfg,
            geometry,
        })
    }

    pub fn config(&self) -> &PhysicsConfig {
        &self.cfg
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn slice_ns(&self) -> u32 {
        self.slice_ns
    }

    /// The muons of a slice (the same for every module).
    pub fn muons(&self, slice: u64) -> Vec<Muon> {
        let mut rng = Pcg64Mcg::seed_from_u64(mix(self.cfg.seed ^ 0x6d75_6f6e ^ mix(slice)));
        let mean = self.cfg.muon_rate_hz * f64::from(self.slice_ns) * 1e-9;
        let n = if mean > 0.0 { Poisson::new(mean).expect("positive mean").sample(&mut rng) as u32 } else { 0 };
        (0..n)
            .map(|id| {
                // Down-going, zenith density ~ cos^2: cos(zenith) = u^(1/3).
                let cz: f64 = rng.random::<f64>().cbrt();
                let sz = (1.0 - cz * cz).max(0.0).sqrt();
                let phi = rng.random::<f64>() * std::f64::consts::TAU;
                let dir = [sz * phi.cos(), sz * phi.sin(), -cz];
                // A point uniform on the disk through the centre, perpendicular to dir.
                let a = if dir[2].abs() < 0.9 { [0.0, 0.0, 1.0] } else { [1.0, 0.0, 0.0] };
                let e1 = {
                    let d = dot(a, dir);
                    let v = [a[0] - d * dir[0], a[1] - d * dir[1], a[2] - d * dir[2]];
                    let k = norm(v);
                    [v[0] / k, v[1] / k, v[2] / k]
                };
                let e2 =
                    [dir[1] * e1[2] - dir[2] * e1[1], dir[2] * e1[0] - dir[0] * e1[2], dir[0] * e1[1] - dir[1] * e1[0]];
                let r = self.gen_radius * rng.random::<f64>().sqrt();
                let psi = rng.random::<f64>() * std::f64::consts::TAU;
                let (u, v) = (r * psi.cos(), r * psi.sin());
                let point = [
                    self.centre[0] + u * e1[0] + v * e2[0],
                    self.centre[1] + u * e1[1] + v * e2[1],
                    self.centre[2] + u * e1[2] + v * e2[2],
                ];
                let t_ns = rng.random::<f64>() * f64::from(self.slice_ns);
                Muon { id, point, dir, t_ns }
            })
            .collect()
    }

    /// Whether `module` is in a bioluminescence burst during `slice` (at its middle).
    pub fn in_burst(&self, module: usize, slice: u64) -> bool {
        self.bursts.in_burst(module as u64, slice)
    }

    fn amplitude(&self, rng: &mut Pcg64Mcg, pe: u32) -> u8 {
        if pe == 1 {
            self.spe_amplitudes[(rng.next_u32() >> 22) as usize]
        } else {
            amplitude(self.cfg.amplitude, rng, pe)
        }
    }

    /// The light of `muon` on one PMT: (expected photo-electrons, arrival time in ns).
    fn muon_light(&self, muon: &Muon, pos: [f64; 3], pmt_dir: [f64; 3]) -> (f64, f64) {
        let v = sub(pos, muon.point);
        let l = dot(v, muon.dir);
        let perp = [v[0] - l * muon.dir[0], v[1] - l * muon.dir[1], v[2] - l * muon.dir[2]];
        let d = norm(perp).max(0.1);
        // Emission point: where the Cherenkov cone through the PMT leaves the track.
        let back = d / self.tan_c;
        let path = d / self.sin_c;
        let t = muon.t_ns + (l - back) / C_LIGHT + path * N_WATER / C_LIGHT;
        // Photon direction at the PMT and the PMT's angular acceptance.
        let q = [
            muon.point[0] + (l - back) * muon.dir[0],
            muon.point[1] + (l - back) * muon.dir[1],
            muon.point[2] + (l - back) * muon.dir[2],
        ];
        let w = sub(pos, q);
        let wn = norm(w).max(1e-9);
        let cos_inc = -dot(pmt_dir, w) / wn;
        // A large OM in a glass sphere still sees light from behind, less of it.
        let acceptance = 0.25 + 0.75 * (1.0 + cos_inc) / 2.0;
        let npe = self.cfg.muon_yield_pe * (-d / self.cfg.attenuation_m).exp() / d * acceptance;
        (npe, t)
    }

    /// The data of module `module` (= source id) in `slice`, with ground truth.
    pub fn generate_with_truth(&self, module: usize, slice: u64) -> TruthFragment {
        let mut origins = Vec::new();
        let (keys, mut rng, burst) = self.sorted_keys(module, slice, Some(&mut origins));
        let fragment = self.finish(&keys, &mut rng, module, burst);
        let hits = keys.iter().map(|&k| unpack_hit_key(k)).collect();
        TruthFragment { fragment, hits, origins }
    }

    /// The data of module `module` in `slice` (what a source sends): the same bytes as
    /// [`Self::generate_with_truth`]'s, without the truth.
    pub fn generate(&self, module: usize, slice: u64) -> GeneratedFragment {
        let (keys, mut rng, burst) = self.sorted_keys(module, slice, None);
        self.finish(&keys, &mut rng, module, burst)
    }

    /// The hits of (module, slice) as keys ([`crate::hit_key`]) sorted by time, each hit's
    /// origin in `origins` when given (in the same order); the module's RNG stream, to draw
    /// the waveforms from next; whether the module is in a burst.
    fn sorted_keys(&self, module: usize, slice: u64, origins: Option<&mut Vec<Origin>>) -> (Vec<u64>, Pcg64Mcg, bool) {
        match self.cfg.version {
            1 => self.sorted_keys_v1(module, slice, origins),
            // Two copies of the loop: one keeps no origins at all.
            _ => match origins {
                Some(origins) => self.sorted_keys_v2(module, slice, origins),
                None => self.sorted_keys_v2(module, slice, NoTruth),
            },
        }
    }

    /// Version 1: every hit drawn in turn (singles PMT by PMT), then sorted by time.
    fn sorted_keys_v1(
        &self,
        module: usize,
        slice: u64,
        origins: Option<&mut Vec<Origin>>,
    ) -> (Vec<u64>, Pcg64Mcg, bool) {
        let span = self.slice_ns.max(1);
        let Some(origins) = origins else {
            let (mut keys, rng, burst) = self.drawn_keys_v1(module, slice, None);
            // A stable sort by time puts the keys in the order of the truth's (time, index)
            // sort below.
            radix_sort_by_time(&mut keys, span);
            return (keys, rng, burst);
        };
        let mut drawn = Vec::new();
        let (keys, rng, burst) = self.drawn_keys_v1(module, slice, Some(&mut drawn));
        // Sort (key time, index) pairs to carry the origins along; the index lives in the
        // low 16 bits, so more hits than that sort by a comparison sort (stable both).
        let order: Vec<usize> = if keys.len() <= 0xffff {
            let mut tagged: Vec<u64> = keys.iter().enumerate().map(|(i, k)| (k >> 16) << 16 | i as u64).collect();
            radix_sort_by_time(&mut tagged, span);
            tagged.iter().map(|k| (k & 0xffff) as usize).collect()
        } else {
            let mut idx: Vec<usize> = (0..keys.len()).collect();
            idx.sort_by_key(|&i| keys[i] >> 16);
            idx
        };
        origins.extend(order.iter().map(|&i| drawn[i]));
        (order.iter().map(|&i| keys[i]).collect(), rng, burst)
    }

    /// Version 1's hits of (module, slice) in the order drawn, each hit's origin pushed to
    /// `origins` when given.
    fn drawn_keys_v1(
        &self,
        module: usize,
        slice: u64,
        mut origins: Option<&mut Vec<Origin>>,
    ) -> (Vec<u64>, Pcg64Mcg, bool) {
        let m: &Module = &self.geometry.modules[module % self.geometry.modules.len()];
        let mut rng = self.module_rng(module, slice);
        let span = self.slice_ns.max(1);
        let burst = self.in_burst(module, slice);
        let rate = self.singles_rate(burst);
        let secs = f64::from(span) * 1e-9;
        // Room for the expected hits and afterpulses (a few percent), so the list rarely grows.
        let expected = rate * secs * m.pmts.len() as f64 * (1.0 + self.cfg.afterpulse_probability);
        let mut keys: Vec<u64> = Vec::with_capacity(expected as usize + 64 + 4 * expected.sqrt() as usize);
        if rate > 0.0 {
            let p = Poisson::new(rate * secs).expect("positive mean");
            for c in 0..m.pmts.len() {
                let n = p.sample(&mut rng) as usize;
                for _ in 0..n {
                    let r = rng.next_u64();
                    // Below `span` by construction: pushed without the range check.
                    let t = ((r >> 32) * u64::from(span)) >> 32;
                    let amp = self.amplitude(&mut rng, 1);
                    keys.push(hit_key(t, c as u64, amp));
                }
                if let Some(origins) = origins.as_deref_mut() {
                    origins.resize(keys.len(), Origin::Singles);
                }
            }
        }
        self.correlated_hits(m, module, slice, &mut rng, &mut |t, channel, amp, o| {
            if t >= 0.0 && t < f64::from(span) {
                keys.push(hit_key(t as u64, channel as u64, amp));
                if let Some(origins) = origins.as_deref_mut() {
                    origins.push(o);
                }
            }
        });
        if self.cfg.afterpulse_probability > 0.0 {
            let n = keys.len();
            for i in 0..n {
                if rng.random::<f64>() < self.cfg.afterpulse_probability {
                    let k = keys[i];
                    let t = (k >> 16) as f64 + rng.random_range(8.0..25.0);
                    let amp = self.amplitude(&mut rng, 1);
                    if t < f64::from(span) {
                        keys.push(hit_key(t as u64, (k >> 8) & 0xff, amp));
                        if let Some(origins) = origins.as_deref_mut() {
                            origins.push(Origin::Afterpulse);
                        }
                    }
                }
            }
        }
        (keys, rng, burst)
    }

    /// Version 2: the hits drawn in time order, so that nothing is sorted afterwards.
    ///
    /// The singles of all the module's PMTs together are one Poisson process in time: each
    /// comes an exponential gap after the one before (a ziggurat draw), with a PMT and an
    /// amplitude from one more 64-bit draw. The genuine coincidences and the muons' light
    /// are drawn first and sorted (a few dozen at the default rates); they, and the
    /// afterpulses, join the stream where their time comes. Which hits afterpulse is a
    /// geometric gap between them (a draw per afterpulse, not one per hit). The
    /// distributions are those of version 1 (independent Poisson singles on every PMT,
    /// uniform in time; each hit afterpulses with the same probability); the bytes are not.
    fn sorted_keys_v2<O: Origins>(&self, module: usize, slice: u64, origins: O) -> (Vec<u64>, Pcg64Mcg, bool) {
        let m: &Module = &self.geometry.modules[module % self.geometry.modules.len()];
        let mut rng = self.module_rng(module, slice);
        let span = u64::from(self.slice_ns.max(1));
        let burst = self.in_burst(module, slice);
        let mut correlated: Vec<(u64, Origin)> = Vec::new();
        self.correlated_hits(m, module, slice, &mut rng, &mut |t, channel, amp, o| {
            if t >= 0.0 && t < span as f64 {
                correlated.push((hit_key(t as u64, channel as u64, amp), o));
            }
        });
        correlated.sort_by_key(|&(k, _)| k);
        // Latest first, so that the next one is popped.
        correlated.reverse();
        let channels = m.pmts.len() as u64;
        // Singles per ns of the whole module.
        let per_ns = self.singles_rate(burst) * channels as f64 * 1e-9;
        let expected = per_ns * span as f64;
        let capacity = expected * (1.0 + self.cfg.afterpulse_probability);
        let mut out = TimeOrdered {
            keys: Vec::with_capacity(capacity as usize + 64 + 4 * capacity.sqrt() as usize + correlated.len()),
            origins,
            correlated,
            afterpulses: Afterpulses::new(self.cfg.afterpulse_probability, &mut rng),
            next_waiting: u64::MAX,
        };
        out.next_waiting = out.earliest_waiting();
        if per_ns > 0.0 {
            let (mean_gap, end) = (1.0 / per_ns, span as f64);
            // The singles' own stream, seeded from the module's: two draws per hit, where
            // xoshiro's short dependency chain lets them overlap.
            let mut singles = Xoshiro256PlusPlus::seed_from_u64(rng.next_u64());
            let mut t = 0.0f64;
            loop {
                t += Distribution::<f64>::sample(&Exp1, &mut singles) * mean_gap;
                if t >= end {
                    break;
                }
                let r = singles.next_u64();
                // The PMT from the low half (multiply-shift), the amplitude from the top 10
                // bits; the time is below 2^32 (a signed conversion is one instruction).
                let channel = ((r & 0xffff_ffff) * channels) >> 32;
                let key = hit_key(t as i64 as u64, channel, self.spe_amplitudes[(r >> 54) as usize]);
                if key > out.next_waiting {
                    out.push_before(key, span, &mut rng, self);
                }
                out.keys.push(key);
                out.origins.push(Origin::Singles);
                out.after(key, span, &mut rng, self);
            }
        }
        out.push_before(u64::MAX, span, &mut rng, self);
        (out.keys, rng, burst)
    }

    /// The module's RNG stream for `slice`: the singles, the genuine coincidences, the
    /// afterpulses and the waveforms.
    fn module_rng(&self, module: usize, slice: u64) -> Pcg64Mcg {
        Pcg64Mcg::seed_from_u64(mix(self.cfg.seed ^ mix(module as u64 ^ mix(slice))))
    }

    /// Singles per PMT per second.
    fn singles_rate(&self, burst: bool) -> f64 {
        self.cfg.singles_hz * if burst { self.cfg.burst_rate_factor } else { 1.0 }
    }

    /// The module's light that is not a single: genuine K-40 coincidences (drawn from
    /// `rng`), then the light of the slice's muons and the neighbouring slices' (light
    /// crosses a slice boundary with the track; drawn from each muon's own stream), each hit
    /// given to `push` as (time in ns from the slice start, PMT, amplitude, origin), the
    /// time possibly outside the slice.
    fn correlated_hits(
        &self,
        m: &Module,
        module: usize,
        slice: u64,
        rng: &mut Pcg64Mcg,
        push: &mut impl FnMut(f64, usize, u8, Origin),
    ) {
        let span = self.slice_ns.max(1);
        let secs = f64::from(span) * 1e-9;
        if self.cfg.coincidence_hz > 0.0 && m.pmts.len() >= 2 {
            let n = Poisson::new(self.cfg.coincidence_hz * secs).expect("positive mean").sample(rng) as usize;
            let jitter = Normal::new(0.0, self.cfg.coincidence_sigma_ns.max(1e-9)).expect("valid");
            for _ in 0..n {
                let t = rng.random::<f64>() * f64::from(span);
                let k = if rng.random::<f64>() < 0.15 { 3 } else { 2 }.min(m.pmts.len());
                let first = rng.random_range(0..m.pmts.len());
                for j in 0..k {
                    let c = (first + j * (1 + m.pmts.len() / k.max(1))) % m.pmts.len();
                    let amp = self.amplitude(rng, 1);
                    push(t + jitter.sample(rng).abs(), c, amp, Origin::Coincidence);
                }
            }
        }
        let jitter = Normal::new(0.0, self.cfg.jitter_ns.max(1e-9)).expect("valid");
        let scatter = Exp::new(1.0 / 3.0).expect("valid");
        for (ds, base) in [(-1i64, -(f64::from(span))), (0, 0.0), (1, f64::from(span))] {
            let Some(s) = slice.checked_add_signed(ds) else { continue };
            // The muon draws must not depend on this module's RNG stream.
            for mu in self.muons(s) {
                let mut mrng = Pcg64Mcg::seed_from_u64(mix(
                    self.cfg.seed ^ mix(module as u64 ^ mix(s ^ mix(u64::from(mu.id) + 7)))
                ));
                for (c, p) in m.pmts.iter().enumerate() {
                    let (npe, t) = self.muon_light(&mu, p.pos, p.dir);
                    if npe < 1e-4 {
                        continue;
                    }
                    let n = Poisson::new(npe).expect("positive mean").sample(&mut mrng) as u32;
                    if n == 0 {
                        continue;
                    }
                    let t = t + base + jitter.sample(&mut mrng) + scatter.sample(&mut mrng) - p.t0_ns;
                    let amp = self.amplitude(&mut mrng, n);
                    push(t, c, amp, Origin::Muon(MuonId { slice: s, index: mu.id }));
                }
            }
        }
    }

    /// The fragment of time-sorted hit `keys`, followed by the module's waveforms drawn
    /// from `rng`.
    fn finish(&self, keys: &[u64], rng: &mut Pcg64Mcg, module: usize, burst: bool) -> GeneratedFragment {
        let channels = self.geometry.modules[module % self.geometry.modules.len()].pmts.len();
        let span = self.slice_ns.max(1);
        let waveforms_per_channel = self.cfg.waveform_hz * f64::from(span) * 1e-9;
        let mut payload = BytesMut::with_capacity(
            keys.len() * HIT_LEN + crate::expected_waveform_bytes(channels, waveforms_per_channel),
        );
        crate::put_hit_keys(&mut payload, keys);
        let waveforms = crate::append_waveforms(&mut payload, rng, channels, waveforms_per_channel, span);
        GeneratedFragment {
            hit_count: keys.len() as u32,
            waveform_count: waveforms,
            payload: payload.freeze(),
            burst,
            opaque: false,
        }
    }
}

/// Version 2's keys in time order as they are drawn, with their origins when the truth is
/// kept, and the hits waiting for their time to come.
struct TimeOrdered<O> {
    keys: Vec<u64>,
    origins: O,
    /// The module's coincidences and muon light not yet placed, latest first.
    correlated: Vec<(u64, Origin)>,
    afterpulses: Afterpulses,
    /// The earliest of the waiting hits (`u64::MAX`: none).
    next_waiting: u64,
}

/// Where version 2 puts each hit's origin, in the keys' order.
trait Origins {
    fn push(&mut self, origin: Origin);
}

/// The origins of a fragment whose truth is not asked for: none kept.
struct NoTruth;

impl Origins for NoTruth {
    #[inline]
    fn push(&mut self, _: Origin) {}
}

impl Origins for &mut Vec<Origin> {
    #[inline]
    fn push(&mut self, origin: Origin) {
        Vec::push(self, origin);
    }
}

impl<O: Origins> TimeOrdered<O> {
    fn earliest_waiting(&self) -> u64 {
        let correlated = self.correlated.last().map_or(u64::MAX, |c| c.0);
        correlated.min(self.afterpulses.pending.last().copied().unwrap_or(u64::MAX))
    }

    /// Places every waiting hit earlier than `key`, in order (a correlated hit may add an
    /// afterpulse of its own; on a tie the correlated hit comes first).
    #[cold]
    fn push_before(&mut self, key: u64, span: u64, rng: &mut Pcg64Mcg, generator: &PhysicsGenerator) {
        loop {
            let next = self.earliest_waiting();
            if next >= key {
                self.next_waiting = next;
                return;
            }
            let origin = if self.correlated.last().is_some_and(|c| c.0 == next) {
                let (_, origin) = self.correlated.pop().expect("the earliest");
                self.after(next, span, rng, generator);
                origin
            } else {
                self.afterpulses.pending.pop();
                Origin::Afterpulse
            };
            self.keys.push(next);
            self.origins.push(origin);
        }
    }

    /// A hit (not an afterpulse) was placed: draws its afterpulse if it has one.
    #[inline]
    fn after(&mut self, key: u64, span: u64, rng: &mut Pcg64Mcg, generator: &PhysicsGenerator) {
        if self.afterpulses.until > 0 {
            self.afterpulses.until -= 1;
        } else if let Some(k) = self.afterpulses.draw(key, span, rng, generator) {
            self.next_waiting = self.next_waiting.min(k);
        }
    }
}

/// Version 2's afterpulses: which hits have one (a geometric gap between them, the same
/// Bernoulli trial per hit as version 1 draws one by one) and those drawn but not yet
/// placed, latest first.
struct Afterpulses {
    /// ln(1 - probability); zero when there are none.
    log_keep: f64,
    /// Hits to pass before the next that has an afterpulse.
    until: u64,
    pending: Vec<u64>,
}

impl Afterpulses {
    fn new(probability: f64, rng: &mut Pcg64Mcg) -> Self {
        let mut a = Self { log_keep: (1.0 - probability).ln(), until: 0, pending: Vec::new() };
        a.until = a.gap(rng);
        a
    }

    fn gap(&self, rng: &mut Pcg64Mcg) -> u64 {
        if self.log_keep == 0.0 {
            return u64::MAX;
        }
        // 1 - u is in (0, 1]: the logarithm is finite.
        ((1.0 - rng.random::<f64>()).ln() / self.log_keep) as u64
    }

    /// The afterpulse of the hit `key`, waiting for its time unless after the slice; the
    /// gap to the next hit that has one.
    #[cold]
    fn draw(&mut self, key: u64, span: u64, rng: &mut Pcg64Mcg, generator: &PhysicsGenerator) -> Option<u64> {
        let t = (key >> 16) as f64 + rng.random_range(8.0..25.0);
        let amp = generator.amplitude(rng, 1);
        self.until = self.gap(rng);
        (t < span as f64).then(|| {
            let k = hit_key(t as u64, (key >> 8) & 0xff, amp);
            let at = self.pending.partition_point(|&p| p > k);
            self.pending.insert(at, k);
            k
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::hit::HitPayload;

    fn antares(cfg: PhysicsConfig) -> PhysicsGenerator {
        PhysicsGenerator::new(cfg, Geometry::antares(10, 30), core::time::Duration::from_millis(10)).unwrap()
    }

    #[test]
    fn deterministic_sorted_and_parsable() {
        let g = antares(PhysicsConfig { waveform_hz: 1650.0, ..Default::default() });
        let a = g.generate_with_truth(17, 1234);
        let b = g.generate_with_truth(17, 1234);
        assert_eq!(a.fragment, b.fragment);
        assert_eq!(a.origins, b.origins);
        assert_ne!(a.fragment.payload, g.generate(18, 1234).payload);
        let p = HitPayload::parse(&a.fragment.payload, a.fragment.hit_count).unwrap();
        let hits: Vec<Hit> = p.hits().collect();
        assert_eq!(hits, a.hits);
        assert!(hits.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        assert!(hits.iter().all(|h| h.channel < 3 && h.time_ns < 10_000_000));
        assert!(a.fragment.waveform_count > 0);
    }

    /// CRC32C of every payload and truth of modules 0..30 in slices 0..40 (bursts and
    /// muons included), for both flavours.
    fn digest(g: &PhysicsGenerator) -> (u32, u32) {
        let (mut bytes, mut truth) = (0u32, 0u32);
        for slice in 0..40 {
            for module in 0..30 {
                let f = g.generate_with_truth(module, slice);
                assert_eq!(f.fragment, g.generate(module, slice));
                bytes = shoal_core::checksum::crc32c_append(bytes, &f.fragment.payload);
                for (h, o) in f.hits.iter().zip(&f.origins) {
                    let o = match o {
                        Origin::Singles => 0,
                        Origin::Coincidence => 1,
                        Origin::Afterpulse => 2,
                        Origin::Muon(id) => (id.slice << 8) | (u64::from(id.index) + 3),
                    };
                    truth = shoal_core::checksum::crc32c_append(truth, &(u64::from(h.time_ns) << 8 ^ o).to_le_bytes());
                }
            }
        }
        (bytes, truth)
    }

    /// The generator's output is part of its interface: the same (seed, module, slice)
    /// gives the same bytes within a version (a change of them is a new version, said in
    /// docs/physics.md). Version 1's digests were taken before the generator was first made
    /// faster (issue 32, goal 5), version 2's when it was written. The muons' light, the
    /// amplitudes and version 2's gaps go through the platform's `exp`, `ln` and `acos`: a
    /// C library that rounds them differently would change bytes too, and fail here first.
    #[test]
    fn the_bytes_of_a_seed_do_not_change() {
        for (version, antares_digest, km3net_digest) in [
            (1, (287_012_272, 1_570_167_543), (962_300_345, 1_866_940_330)),
            (2, (293_072_588, 1_098_924_902), (838_307_194, 2_944_970_437)),
        ] {
            let muons = PhysicsConfig { muon_rate_hz: 500.0, burst_fraction: 0.3, version, ..Default::default() };
            assert_eq!(digest(&antares(muons)), antares_digest, "version {version}");
            let km3 = PhysicsGenerator::new(
                PhysicsConfig { muon_rate_hz: 500.0, version, ..PhysicsConfig::km3net() },
                Geometry::antares(10, 30),
                core::time::Duration::from_millis(10),
            )
            .unwrap();
            assert_eq!(digest(&km3), km3net_digest, "version {version}");
        }
    }

    #[test]
    fn an_unknown_version_is_refused() {
        let cfg = PhysicsConfig { version: 3, ..Default::default() };
        let err = PhysicsGenerator::new(cfg, Geometry::antares(1, 3), core::time::Duration::from_millis(10));
        assert!(matches!(err, Err(ConfigError::UnknownVersion(3))), "{err:?}");
    }

    /// Both versions draw the same distributions: Poisson singles on every PMT at the
    /// configured rate, uniform over the slice, and the configured share of afterpulses.
    #[test]
    fn both_versions_draw_the_same_distributions() {
        for version in PHYSICS_VERSIONS {
            let cfg = PhysicsConfig {
                burst_fraction: 0.0,
                muon_rate_hz: 0.0,
                coincidence_hz: 0.0,
                version,
                ..Default::default()
            };
            let g = antares(cfg);
            let (mut per_pmt, mut per_tenth, mut singles, mut after) = ([0u64; 3], [0u64; 10], 0u64, 0u64);
            let mut per_slice = Vec::new();
            for s in 0..200 {
                let f = g.generate_with_truth(7, s);
                assert!(f.hits.windows(2).all(|w| w[0].time_ns <= w[1].time_ns), "version {version}: sorted");
                let mut n = 0u64;
                for (h, o) in f.hits.iter().zip(&f.origins) {
                    match o {
                        Origin::Singles => {
                            per_pmt[usize::from(h.channel)] += 1;
                            per_tenth[(h.time_ns / 1_000_000) as usize] += 1;
                            singles += 1;
                            n += 1;
                        }
                        Origin::Afterpulse => after += 1,
                        o => panic!("{o:?} not configured"),
                    }
                }
                per_slice.push(n as f64);
            }
            // 3 PMTs x 70 kHz x 2 s = 420,000 singles (sd 648); 140,000 per PMT (sd 374),
            // 42,000 per tenth of the slice (sd 205): 5 sd each.
            assert!((singles as f64 - 420_000.0).abs() < 3_300.0, "version {version}: {singles}");
            for n in per_pmt {
                assert!((n as f64 - 140_000.0).abs() < 1_900.0, "version {version}: per PMT {per_pmt:?}");
            }
            for n in per_tenth {
                assert!((n as f64 - 42_000.0).abs() < 1_030.0, "version {version}: per tenth {per_tenth:?}");
            }
            // Poisson per slice: the variance is the mean (2,100; the sample variance of 200
            // slices has a standard error of 10%).
            let mean = per_slice.iter().sum::<f64>() / per_slice.len() as f64;
            let var = per_slice.iter().map(|n| (n - mean).powi(2)).sum::<f64>() / (per_slice.len() - 1) as f64;
            assert!((var / mean - 1.0).abs() < 0.4, "version {version}: variance {var} of mean {mean}");
            // 2% of 420,000 (sd 91), fewer the few after the slice's end.
            let frac = after as f64 / singles as f64;
            assert!((frac - 0.02).abs() < 0.0012, "version {version}: afterpulses {frac}");
        }
    }

    /// Version 2 puts the correlated hits and the afterpulses in order among the singles,
    /// ties included, at any rate; without singles they are still there, in order.
    #[test]
    fn version_2_keeps_every_kind_of_hit_in_order() {
        for singles_hz in [0.0, 70_000.0, 30_000_000.0] {
            let cfg = PhysicsConfig {
                singles_hz,
                coincidence_hz: 5_000.0,
                afterpulse_probability: 0.3,
                muon_rate_hz: 2_000.0,
                burst_fraction: 0.0,
                ..Default::default()
            };
            let g = antares(cfg);
            let mut kinds = [0u64; 4];
            for (m, s) in [(0, 3), (40, 4), (150, 5), (299, 6)] {
                let f = g.generate_with_truth(m, s);
                assert_eq!(f.fragment, g.generate(m, s));
                assert!(f.hits.windows(2).all(|w| w[0].time_ns <= w[1].time_ns), "{singles_hz} Hz: sorted");
                for o in &f.origins {
                    kinds[match o {
                        Origin::Singles => 0,
                        Origin::Coincidence => 1,
                        Origin::Afterpulse => 2,
                        Origin::Muon(_) => 3,
                    }] += 1;
                }
            }
            assert_eq!(kinds[0] == 0, singles_hz == 0.0, "{kinds:?}");
            assert!(kinds[1] > 100 && kinds[2] > 50 && kinds[3] > 0, "{singles_hz} Hz: {kinds:?}");
        }
    }

    #[test]
    fn background_rates_and_afterpulses() {
        let cfg = PhysicsConfig { burst_fraction: 0.0, muon_rate_hz: 0.0, ..Default::default() };
        let g = antares(cfg);
        let (mut singles, mut coinc, mut after) = (0u64, 0u64, 0u64);
        for s in 0..50 {
            for o in g.generate_with_truth(5, s).origins {
                match o {
                    Origin::Singles => singles += 1,
                    Origin::Coincidence => coinc += 1,
                    Origin::Afterpulse => after += 1,
                    Origin::Muon(_) => panic!("no muons configured"),
                }
            }
        }
        // 3 PMTs x 70 kHz x 0.5 s = 105,000 singles (sd ~ 324).
        assert!((singles as f64 - 105_000.0).abs() < 2_000.0, "{singles}");
        // 2% afterpulses of everything before them.
        let frac = after as f64 / (singles + coinc) as f64;
        assert!((frac - 0.02).abs() < 0.002, "{frac}");
        // 15 Hz x 0.5 s = 7.5 coincidences of 2-3 hits.
        assert!(coinc < 100, "{coinc}");
    }

    #[test]
    fn bursts_cover_about_five_percent_and_raise_the_rate() {
        let g = antares(PhysicsConfig { muon_rate_hz: 0.0, ..Default::default() });
        // 60 modules x 100 s of 10 ms slices sampled every 50 ms.
        let mut n = 0u32;
        let mut burst = 0u32;
        for m in 0..60 {
            for s in (0..10_000u64).step_by(5) {
                n += 1;
                burst += u32::from(g.in_burst(m, s));
            }
        }
        let f = f64::from(burst) / f64::from(n);
        assert!((0.02..0.09).contains(&f), "burst fraction {f}");
        let (m, s) = (0..60)
            .flat_map(|m| (0..10_000u64).step_by(5).map(move |s| (m, s)))
            .find(|&(m, s)| g.in_burst(m, s))
            .unwrap();
        let f = g.generate(m, s);
        assert!(f.burst && f.hit_count > 3 * 2100, "{}", f.hit_count);
    }

    #[test]
    fn muon_light_follows_the_cherenkov_cone() {
        // A vertical down-going muon 20 m from a PMT facing it: the light arrives when the
        // cone passes, t = t0 + (l - d/tan)/c + d n/(c sin); the PMT sees a few pe.
        let g = antares(PhysicsConfig::default());
        let mu = Muon { id: 0, point: [0.0, 0.0, 0.0], dir: [0.0, 0.0, -1.0], t_ns: 100.0 };
        let (npe, t) = g.muon_light(&mu, [20.0, 0.0, -50.0], [-1.0, 0.0, 0.0]);
        let th = cherenkov_angle();
        let expect = 100.0 + (50.0 - 20.0 / th.tan()) / C_LIGHT + 20.0 / th.sin() * N_WATER / C_LIGHT;
        assert!((t - expect).abs() < 1e-9);
        assert!(npe > 1.0 && npe < 5.0, "{npe}");
        // Causality: the arrival time difference of two PMTs is within d * n / c.
        let (_, t2) = g.muon_light(&mu, [20.0, 10.0, -80.0], [-1.0, 0.0, 0.0]);
        let d = (10f64.powi(2) + 30f64.powi(2)).sqrt();
        assert!((t2 - t).abs() <= d * N_WATER / C_LIGHT);
    }

    #[test]
    fn muons_leave_ground_truth_hits() {
        let g = antares(PhysicsConfig { muon_rate_hz: 2000.0, burst_fraction: 0.0, ..Default::default() });
        let signal: usize = (0..300)
            .map(|m| g.generate_with_truth(m, 9).origins.iter().filter(|o| matches!(o, Origin::Muon(_))).count())
            .sum();
        assert!(signal > 100, "{signal} signal hits from ~20 muons");
    }
}
