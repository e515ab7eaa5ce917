//! The muon filter: L1 local coincidences, the causality cluster trigger (3D, optional
//! direction scan) and event building (physics.md section 2).
//!
//! Steps for one slice:
//! 1. **L1** per module ([`l1_hit_indices`]): ANTARES: a hit with a partner on a *different* PMT
//!    of the floor within `l1.window_ns`, or with amplitude at least `l1.high_amplitude`;
//!    KM3NeT: a hit with any other hit of the DOM within `l1.window_ns` (the same PMT may
//!    count twice).
//!    A module above `rate_veto_hz` per PMT in the slice (a bioluminescence burst) is left
//!    out of the trigger (counted); its hits still join events.
//! 2. **Trigger hits**: the L1 hits of a module within `l1.window_ns` of each other merge
//!    into one trigger hit (earliest calibrated time, that PMT's position), so that one
//!    local coincidence counts once.
//! 3. **Causality clusters** ([`clusters`]): for each trigger hit (seed), the trigger hits in
//!    `[t, t + window_ns]` causally related to it (`|dt| <= d n / c + t_extra_ns`); while
//!    they are not all pairwise related, the one with the fewest relations (the latest on
//!    ties) is removed; a clique of at least `min_hits` trigger hits on `min_modules`
//!    modules fires. With `direction_scan`, it must also be a clique of at least
//!    `min_hits` under the road test of some direction of a grid (`|dt - dz/c| <=
//!    R tan(theta_c)/c + t_extra_ns` for transverse distance `R <= road_width_m`), and
//!    pairs must pass the road bound that test implies for every direction (`|dt| <= d/c +
//!    road_width_m tan(theta_c)/c + t_extra_ns`, the "3B" test).
//!    The members of a firing cluster are not used as seeds again.
//! 4. **Events** ([`build_events`]): every L0 hit within `snapshot_ns` of a firing cluster;
//!    overlapping windows merge into one event, counted in `overlays`. Hits of the firing
//!    clusters are flagged triggered.

use serde::{Deserialize, Serialize};
use shoal_core::hit::Hit;
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{C_LIGHT, N_WATER};

use crate::scan::{DirectionScan, ScanScratch};
pub use crate::track::{
    CliqueScratch, Road, TriggerHit, causal, causal_along, direction_grid, distance, prune_to_clique, tan_cherenkov,
};
use crate::track::{DEFAULT_SCAN_STEP_DEG, distinct_modules};
use crate::{Event, EventHit, Filter, FilterConfig, FilterError, SliceData, SliceHits};

/// Trigger bit of the causality cluster trigger.
pub const TRIGGER_3D: u32 = 1 << 1;
/// Trigger bit of the direction-scan confirmation.
pub const TRIGGER_3D_SCAN: u32 = 1 << 2;

/// Which L1 definition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum L1Kind {
    /// Different PMTs of one floor within the window, or one large hit.
    Antares,
    /// Two hits of one DOM within the window (same PMT allowed).
    Km3net,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct L1Params {
    pub kind: L1Kind,
    /// ANTARES 20 ns; KM3NeT TMaxLocal 25 ns (10 and 15 also seen).
    pub window_ns: u32,
    /// ANTARES: a hit with at least this amplitude is an L1 alone (30 = 3 p.e. in the
    /// generator's charge units; 0: off).
    pub high_amplitude: u8,
}

impl Default for L1Params {
    fn default() -> Self {
        Self { kind: L1Kind::Antares, window_ns: 20, high_amplitude: 30 }
    }
}

/// Parameters of the muon filter (`[builder.filter.muon]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MuonConfig {
    pub l1: L1Params,
    /// `antares` (one floor per source) or the path of a `.detx` file.
    pub geometry: String,
    /// Longest time span of a cluster, ns (ANTARES 3N: 2.2 us).
    pub window_ns: u32,
    /// Added to the light-travel time in the causality test, ns (20-25).
    pub t_extra_ns: f64,
    pub min_hits: usize,
    pub min_modules: usize,
    pub direction_scan: bool,
    /// Grid step of the direction scan, degrees (ORCA 10, ARCA 1).
    pub scan_step_deg: f64,
    pub road_width_m: f64,
    /// L0 hits this long before and after a firing cluster join the event, ns.
    pub snapshot_ns: u32,
    /// High-rate veto: a module whose mean rate per PMT over the slice exceeds this (Hz)
    /// is left out of the trigger (its hits still join events), counted in
    /// [`MuonStats::vetoed_modules`]. 0: off.
    pub rate_veto_hz: f64,
}

impl MuonConfig {
    /// The road test's widest time window, ns: `road_width_m tan(theta_c) / c + t_extra`
    /// (a pair's bound beyond the light's travel, and the direction scan's window in tau).
    pub fn road_time_ns(&self) -> f64 {
        self.road().road_time_ns()
    }

    /// What the direction scan holds a cluster to.
    pub fn road(&self) -> Road {
        Road {
            road_width_m: self.road_width_m,
            t_extra_ns: self.t_extra_ns,
            min_hits: self.min_hits,
            min_modules: self.min_modules,
        }
    }
}

impl Default for MuonConfig {
    fn default() -> Self {
        let road = Road::default();
        Self {
            l1: L1Params::default(),
            geometry: "antares".into(),
            window_ns: 2_200,
            t_extra_ns: road.t_extra_ns,
            min_hits: road.min_hits,
            min_modules: road.min_modules,
            direction_scan: false,
            scan_step_deg: DEFAULT_SCAN_STEP_DEG,
            road_width_m: road.road_width_m,
            snapshot_ns: 1_000,
            rate_veto_hz: 200_000.0,
        }
    }
}

/// The indices of one module's time-sorted hits that are L1, ascending.
///
/// Each hit looks for a partner on both sides, so that the answer is a short list (a few
/// per cent of the hits) and the trigger hits are built from it without a pass over a
/// flag per hit.
pub fn l1_hit_indices(hits: &[Hit], p: &L1Params, out: &mut Vec<usize>) {
    out.clear();
    let w = p.window_ns;
    for (i, h) in hits.iter().enumerate() {
        let after = |o: &&Hit| o.time_ns - h.time_ns <= w;
        let before = |o: &&Hit| h.time_ns - o.time_ns <= w;
        let l1 = match p.kind {
            // Sorted: a hit has a partner iff a neighbour is within the window.
            L1Kind::Km3net => hits.get(i + 1).is_some_and(|o| after(&o)) || (i > 0 && before(&&hits[i - 1])),
            L1Kind::Antares => {
                (p.high_amplitude > 0 && h.amplitude >= p.high_amplitude)
                    || hits[i + 1..].iter().take_while(after).any(|o| o.channel != h.channel)
                    || hits[..i].iter().rev().take_while(before).any(|o| o.channel != h.channel)
            }
        };
        if l1 {
            out.push(i);
        }
    }
}

/// A firing cluster: indices into the trigger hits, and its trigger bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cluster {
    pub members: Vec<usize>,
    pub mask: u32,
}

/// The causality clusters of time-sorted trigger hits (see the module documentation);
/// `scan` confirms them when `cfg.direction_scan` is on.
pub fn clusters(hits: &[TriggerHit], cfg: &MuonConfig, scan: &DirectionScan) -> Vec<Cluster> {
    let mut out = Vec::new();
    let mut scratch = ScanScratch::default();
    let mut clique = CliqueScratch::default();
    let window = f64::from(cfg.window_ns);
    let mut end = 0;
    let mut members = Vec::new();
    // Members of a firing cluster are not seeds again (one cluster, one trigger; and a
    // bright event with hundreds of L1 hits costs one clustering, not hundreds).
    let mut taken = vec![false; hits.len()];
    // With the direction scan, pairs must also pass the road bound every direction's test
    // implies (|dt| <= d/c + R tan(theta_c)/c + t_extra): far tighter than the light cone
    // over hundreds of metres, so far fewer candidates reach the scan.
    let road_t = cfg.road_time_ns();
    let related = |a: &TriggerHit, b: &TriggerHit| {
        // `causal` and the road bound, the distance computed once for both.
        let (dt, d) = ((a.t - b.t).abs(), distance(a.pos, b.pos));
        dt <= d * N_WATER / C_LIGHT + cfg.t_extra_ns && (!cfg.direction_scan || dt <= d / C_LIGHT + road_t)
    };
    for i in 0..hits.len() {
        end = end.max(i + 1);
        if taken[i] {
            continue;
        }
        while end < hits.len() && hits[end].t - hits[i].t <= window {
            end += 1;
        }
        if end - i < cfg.min_hits {
            continue;
        }
        members.clear();
        members.push(i);
        members.extend((i + 1..end).filter(|&j| related(&hits[i], &hits[j])));
        if members.len() < cfg.min_hits {
            continue;
        }
        prune_to_clique(&mut members, |a, b| related(&hits[a], &hits[b]), &mut clique);
        if members.len() < cfg.min_hits || distinct_modules(hits, &members) < cfg.min_modules {
            continue;
        }
        let mut mask = TRIGGER_3D;
        if cfg.direction_scan {
            let confirmed = scan.confirms(hits, &members, &cfg.road(), &mut scratch);
            if !confirmed {
                continue;
            }
            mask |= TRIGGER_3D_SCAN;
        }
        for &m in &members {
            taken[m] = true;
        }
        out.push(Cluster { members: members.clone(), mask });
    }
    out
}

/// An event window before hits are collected: calibrated times and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct EventWindow {
    pub start: f64,
    pub end: f64,
    pub mask: u32,
    /// Firing clusters merged into it (1 = no overlay).
    pub clusters: u32,
    /// Trigger hits of its firing clusters.
    pub trigger_hits: Vec<usize>,
}

/// Snapshot windows of the firing clusters, overlapping ones merged.
pub fn build_events(hits: &[TriggerHit], clusters: &[Cluster], snapshot_ns: f64) -> Vec<EventWindow> {
    let mut windows: Vec<EventWindow> = clusters
        .iter()
        .map(|c| {
            let t0 = c.members.iter().map(|&i| hits[i].t).fold(f64::INFINITY, f64::min);
            let t1 = c.members.iter().map(|&i| hits[i].t).fold(f64::NEG_INFINITY, f64::max);
            EventWindow {
                start: t0 - snapshot_ns,
                end: t1 + snapshot_ns,
                mask: c.mask,
                clusters: 1,
                trigger_hits: c.members.clone(),
            }
        })
        .collect();
    windows.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut merged: Vec<EventWindow> = Vec::new();
    for w in windows {
        match merged.last_mut() {
            Some(m) if w.start <= m.end => {
                m.end = m.end.max(w.end);
                m.mask |= w.mask;
                m.clusters += w.clusters;
                m.trigger_hits.extend(w.trigger_hits);
            }
            _ => merged.push(w),
        }
    }
    for m in &mut merged {
        m.trigger_hits.sort_unstable();
        m.trigger_hits.dedup();
    }
    merged
}

/// The `muon` filter.
#[derive(Debug, Default)]
pub struct MuonFilter {
    cfg: MuonConfig,
    geometry: Option<Geometry>,
    scan: DirectionScan,
    /// The slice's hits, one fragment at a time, and the L1 hits of the fragment being
    /// read (reused for every fragment, so they stay in the cache).
    hits: SliceHits,
    l1_of_module: Vec<usize>,
    /// The slice's L1 hits that joined trigger hits, as (fragment, hit index), ascending.
    l1_hits: Vec<(usize, usize)>,
    /// The slice's merged local coincidences (a reused buffer: an ARCA slice's, grown
    /// afresh every slice, had the kernel clear new pages for it, 10 % of the trigger's time).
    trig: Vec<TriggerHit>,
    /// Counters for the evaluation.
    pub stats: MuonStats,
}

/// What the filter saw, summed over slices.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MuonStats {
    pub slices: u64,
    pub l0_hits: u64,
    pub l1_hits: u64,
    pub trigger_hits: u64,
    pub clusters: u64,
    pub events: u64,
    /// Hits of modules the geometry does not know (not in the trigger).
    pub unknown_module_hits: u64,
    /// Module-slices left out of the trigger by the high-rate veto.
    pub vetoed_modules: u64,
}

impl MuonFilter {
    pub fn new(cfg: MuonConfig, geometry: Geometry) -> Self {
        let scan = if cfg.direction_scan {
            DirectionScan::new(&direction_grid(cfg.scan_step_deg), cfg.scan_step_deg)
        } else {
            DirectionScan::default()
        };
        Self { cfg, geometry: Some(geometry), scan, ..Default::default() }
    }

    /// Makes sure the geometry covers source `max_source` (the `antares` geometry grows
    /// with the sources seen; a `.detx` geometry is what it is).
    fn ensure_geometry(&mut self, max_source: u32) {
        let need = max_source as usize + 1;
        if self.cfg.geometry == "antares" && self.geometry.as_ref().is_none_or(|g| g.modules.len() < need) {
            self.geometry = Some(Geometry::antares_for_sources(need as u32));
        }
    }

    /// Runs L1, clusters and event building on one slice; returns its events (counters in
    /// [`MuonFilter::stats`]).
    pub fn process_slice(&mut self, slice: &SliceData) -> Vec<Event> {
        let max_source = slice.fragments.iter().map(|f| f.source).max().unwrap_or(0);
        self.ensure_geometry(max_source);
        // Moved out for the slice (and back below) instead of cloned per slice: the
        // per-fragment buffers of `self` are borrowed mutably meanwhile.
        let geometry = self.geometry.take().unwrap_or_default();
        let cfg = std::mem::take(&mut self.cfg);
        let events = self.process_with(slice, &geometry, &cfg);
        self.geometry = Some(geometry);
        self.cfg = cfg;
        events
    }

    fn process_with(&mut self, slice: &SliceData, geometry: &Geometry, cfg: &MuonConfig) -> Vec<Event> {
        let n = slice.fragments.len();
        let mut trig = std::mem::take(&mut self.trig);
        trig.clear();
        self.l1_hits.clear();
        self.hits.clear();
        for (fi, f) in slice.fragments.iter().enumerate() {
            let hits = self.hits.read(f);
            self.stats.l0_hits += hits.len() as u64;
            let l1 = &mut self.l1_of_module;
            l1_hit_indices(hits, &cfg.l1, l1);
            let Some(module) = geometry.modules.get(f.source as usize) else {
                self.stats.unknown_module_hits += hits.len() as u64;
                continue;
            };
            if cfg.rate_veto_hz > 0.0 && slice.slice_ns > 0 {
                let per_pmt = hits.len() as f64 / module.pmts.len().max(1) as f64 / (slice.slice_ns as f64 * 1e-9);
                if per_pmt > cfg.rate_veto_hz {
                    self.stats.vetoed_modules += 1;
                    continue;
                }
            }
            // A trigger hit starts at each L1 hit not yet merged and takes in every hit
            // within the window of it; the L1 ones among those are merged into it.
            let mut p = 0;
            while p < l1.len() {
                let first = l1[p];
                let mut j = first + 1;
                while j < hits.len() && hits[j].time_ns - hits[first].time_ns <= cfg.l1.window_ns {
                    j += 1;
                }
                let q = p + l1[p..].partition_point(|&k| k < j);
                self.l1_hits.extend(l1[p..q].iter().map(|&k| (fi, k)));
                self.stats.l1_hits += (q - p) as u64;
                let pmt = module.pmts.get(usize::from(hits[first].channel));
                trig.push(TriggerHit {
                    t: f64::from(hits[first].time_ns) + pmt.map_or(0.0, |p| p.t0_ns),
                    pos: pmt.map_or(module.pos, |p| p.pos),
                    module: fi,
                    hit: first,
                    hit_end: j,
                });
                p = q;
            }
        }
        // By time, ties in the order pushed (module, then hit): the stable order, without the
        // stable sort's scratch buffer.
        trig.sort_unstable_by(|a, b| a.t.total_cmp(&b.t).then(a.module.cmp(&b.module)).then(a.hit.cmp(&b.hit)));
        self.stats.slices += 1;
        self.stats.trigger_hits += trig.len() as u64;
        let cl = clusters(&trig, cfg, &self.scan);
        self.stats.clusters += cl.len() as u64;
        let windows = build_events(&trig, &cl, f64::from(cfg.snapshot_ns));
        self.stats.events += windows.len() as u64;

        // Collect the L0 hits of each window; flag the L1 hits of its firing clusters.
        let t0_range = |m: usize| -> (f64, f64) {
            geometry.modules.get(slice.fragments[m].source as usize).map_or((0.0, 0.0), |md| {
                md.pmts
                    .iter()
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.t0_ns), hi.max(p.t0_ns)))
            })
        };
        let offsets: Vec<(f64, f64)> =
            (0..n).map(t0_range).map(|(lo, hi)| if lo.is_finite() { (lo, hi) } else { (0.0, 0.0) }).collect();
        let sorted = self.hits.sorted(slice);
        let mut events = Vec::with_capacity(windows.len());
        for (id, w) in windows.iter().enumerate() {
            let mut triggered: Vec<(usize, usize)> = Vec::new();
            for &ti in &w.trigger_hits {
                let th = &trig[ti];
                let from = self.l1_hits.partition_point(|&x| x < (th.module, th.hit));
                let to = self.l1_hits.partition_point(|&x| x < (th.module, th.hit_end));
                triggered.extend_from_slice(&self.l1_hits[from..to]);
            }
            triggered.sort_unstable();
            let mut hits_out = Vec::new();
            for (fi, fh) in sorted.iter().enumerate() {
                let module = geometry.modules.get(slice.fragments[fi].source as usize);
                let (lo, hi) = offsets[fi];
                let a = fh.partition_point_by_time(|t| f64::from(t) + hi < w.start);
                let b = fh.partition_point_by_time(|t| f64::from(t) + lo <= w.end);
                for k in a..b {
                    let h = fh.get(k);
                    let t0 = module.and_then(|m| m.pmts.get(usize::from(h.channel))).map_or(0.0, |p| p.t0_ns);
                    let t = f64::from(h.time_ns) + t0;
                    if t < w.start || t > w.end {
                        continue;
                    }
                    let is_trig = triggered.binary_search(&(fi, k)).is_ok();
                    hits_out.push(EventHit::from_hit(slice.fragments[fi].source, h, is_trig));
                }
            }
            hits_out.sort_unstable_by_key(|h| (h.time_ns, h.source, h.channel));
            events.push(Event { id: id as u32, trigger_mask: w.mask, overlays: w.clusters - 1, hits: hits_out });
        }
        self.trig = trig;
        events
    }
}

impl Filter for MuonFilter {
    fn init(&mut self, config: &FilterConfig) -> Result<(), FilterError> {
        let c = &config.muon;
        if c.min_hits == 0 || c.min_modules == 0 {
            return Err(FilterError::BadParameter("muon.min_hits and muon.min_modules must be at least 1".into()));
        }
        if !(c.t_extra_ns.is_finite() && c.t_extra_ns >= 0.0 && c.road_width_m > 0.0) {
            return Err(FilterError::BadParameter("muon.t_extra_ns >= 0 and muon.road_width_m > 0".into()));
        }
        let geometry = if c.geometry == "antares" {
            Geometry::antares(10, 30)
        } else {
            let text = std::fs::read_to_string(&c.geometry)
                .map_err(|e| FilterError::BadParameter(format!("muon.geometry {:?}: {e}", c.geometry)))?;
            Geometry::from_detx(&text).map_err(|e| FilterError::BadParameter(format!("muon.geometry: {e}")))?
        };
        *self = MuonFilter::new(c.clone(), geometry);
        Ok(())
    }

    fn process(&mut self, slice: &SliceData) -> Vec<Event> {
        self.process_slice(slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FragmentData;
    use bytes::BytesMut;
    use proptest::prelude::*;

    /// L1 by definition, pair by pair.
    fn brute_l1(hits: &[Hit], p: &L1Params) -> Vec<bool> {
        (0..hits.len())
            .map(|i| {
                let high = p.kind == L1Kind::Antares && p.high_amplitude > 0 && hits[i].amplitude >= p.high_amplitude;
                high || (0..hits.len()).any(|j| {
                    j != i
                        && hits[i].time_ns.abs_diff(hits[j].time_ns) <= p.window_ns
                        && (p.kind == L1Kind::Km3net || hits[j].channel != hits[i].channel)
                })
            })
            .collect()
    }

    /// The clustering by its definition, recomputing every count from scratch at each step.
    fn brute_clusters(hits: &[TriggerHit], cfg: &MuonConfig) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for i in 0..hits.len() {
            if out.iter().any(|c| c.contains(&i)) {
                continue;
            }
            let window: Vec<usize> =
                (i..hits.len()).filter(|&j| hits[j].t - hits[i].t <= f64::from(cfg.window_ns)).collect();
            if window.len() < cfg.min_hits {
                continue;
            }
            let mut set: Vec<usize> =
                window.into_iter().filter(|&j| j == i || causal(&hits[i], &hits[j], cfg.t_extra_ns)).collect();
            if set.len() < cfg.min_hits {
                continue;
            }
            loop {
                let count =
                    |a: usize| set.iter().filter(|&&b| b != a && causal(&hits[a], &hits[b], cfg.t_extra_ns)).count();
                if set.iter().all(|&a| count(a) + 1 == set.len()) {
                    break;
                }
                // Fewest relations, the latest on ties.
                let worst = *set.iter().rev().min_by_key(|&&a| count(a)).unwrap();
                set.retain(|&a| a != worst);
            }
            let mut modules: Vec<usize> = set.iter().map(|&a| hits[a].module).collect();
            modules.sort_unstable();
            modules.dedup();
            if set.len() >= cfg.min_hits && modules.len() >= cfg.min_modules {
                out.push(set);
            }
        }
        out
    }

    fn trigger_hits(raw: &[(u8, u32, u8)], modules: &[[f64; 3]]) -> Vec<TriggerHit> {
        let mut v: Vec<TriggerHit> = raw
            .iter()
            .enumerate()
            .map(|(k, &(m, t, _))| {
                let m = usize::from(m) % modules.len();
                TriggerHit { t: f64::from(t), pos: modules[m], module: m, hit: k, hit_end: k + 1 }
            })
            .collect();
        v.sort_by(|a, b| a.t.total_cmp(&b.t));
        v
    }

    proptest! {
        #[test]
        fn l1_matches_the_definition(
            raw in proptest::collection::vec((0u8..31, 0u32..3000, 0u8..60), 0..120),
            window in 0u32..40, high in 0u8..60, km3net in any::<bool>(),
        ) {
            let mut hits: Vec<Hit> = raw.into_iter().map(|(channel, time_ns, amplitude)| Hit { channel, time_ns, amplitude }).collect();
            hits.sort_unstable();
            let p = L1Params { kind: if km3net { L1Kind::Km3net } else { L1Kind::Antares }, window_ns: window, high_amplitude: high };
            let mut got = Vec::new();
            l1_hit_indices(&hits, &p, &mut got);
            let want: Vec<usize> = brute_l1(&hits, &p).into_iter().enumerate().filter(|&(_, l1)| l1).map(|(i, _)| i).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn clusters_match_the_definition_and_are_causal_cliques(
            raw in proptest::collection::vec((0u8..8, 0u32..4000, 0u8..1), 0..40),
            pos in proptest::collection::vec((0.0f64..120.0, 0.0f64..120.0, 0.0f64..120.0), 8),
            min_hits in 2usize..6, min_modules in 1usize..5, window in 200u32..3000,
        ) {
            let modules: Vec<[f64; 3]> = pos.into_iter().map(|(x, y, z)| [x, y, z]).collect();
            let hits = trigger_hits(&raw, &modules);
            let cfg = MuonConfig { min_hits, min_modules, window_ns: window, ..Default::default() };
            let got = clusters(&hits, &cfg, &DirectionScan::default());
            let want = brute_clusters(&hits, &cfg);
            prop_assert_eq!(got.iter().map(|c| c.members.clone()).collect::<Vec<_>>(), want);
            for c in &got {
                for &a in &c.members {
                    for &b in &c.members {
                        prop_assert!(causal(&hits[a], &hits[b], cfg.t_extra_ns));
                    }
                }
                prop_assert!(c.members.len() >= min_hits);
                prop_assert!(distinct_modules(&hits, &c.members) >= min_modules);
            }
        }

        #[test]
        fn event_windows_merge_exactly_the_overlapping(
            spans in proptest::collection::vec((0u32..100_000, 0u32..5_000), 0..30), snapshot in 0u32..3000,
        ) {
            // One cluster per span: two trigger hits at its ends.
            let mut hits = Vec::new();
            let mut cl = Vec::new();
            for (k, &(t, len)) in spans.iter().enumerate() {
                for dt in [0, len] {
                    hits.push(TriggerHit { t: f64::from(t + dt), pos: [0.0; 3], module: k, hit: 0, hit_end: 1 });
                }
                cl.push(Cluster { members: vec![2 * k, 2 * k + 1], mask: 1 << (k % 3) });
            }
            let ev = build_events(&hits, &cl, f64::from(snapshot));
            // Windows are disjoint and ordered; every cluster's window is inside exactly one
            // event; the overlay counts add up.
            prop_assert!(ev.windows(2).all(|w| w[0].end < w[1].start));
            prop_assert_eq!(ev.iter().map(|e| e.clusters as usize).sum::<usize>(), cl.len());
            for (k, &(t, len)) in spans.iter().enumerate() {
                let (a, b) = (f64::from(t) - f64::from(snapshot), f64::from(t + len) + f64::from(snapshot));
                let inside: Vec<_> = ev.iter().filter(|e| e.start <= a && b <= e.end).collect();
                prop_assert_eq!(inside.len(), 1);
                prop_assert!(inside[0].trigger_hits.contains(&(2 * k)));
                prop_assert!(inside[0].mask & (1 << (k % 3)) != 0);
            }
            // Brute force: two windows share an event iff they are connected by overlaps.
            let n = spans.len();
            let win = |k: usize| (f64::from(spans[k].0) - f64::from(snapshot), f64::from(spans[k].0 + spans[k].1) + f64::from(snapshot));
            let mut group: Vec<usize> = (0..n).collect();
            loop {
                let mut changed = false;
                for a in 0..n {
                    for b in 0..n {
                        let (wa, wb) = (win(a), win(b));
                        if wa.0 <= wb.1 && wb.0 <= wa.1 && group[a] != group[b] {
                            let g = group[a].min(group[b]);
                            group[a] = g;
                            group[b] = g;
                            changed = true;
                        }
                    }
                }
                if !changed { break; }
            }
            let mut groups = group.clone();
            groups.sort_unstable();
            groups.dedup();
            prop_assert_eq!(groups.len(), ev.len());
        }
    }

    /// The filter reads a payload whose hits are in time order in place and sorts a copy
    /// of one that is not: the events must not tell the two apart.
    #[test]
    fn payloads_out_of_time_order_give_the_events_of_the_same_hits_in_order() {
        use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
        let g = Geometry::antares(2, 30);
        let physics = PhysicsConfig { muon_rate_hz: 2_000.0, waveform_hz: 0.0, ..PhysicsConfig::default() };
        let generator = PhysicsGenerator::new(physics, g.clone(), core::time::Duration::from_millis(10)).unwrap();
        let mut in_order = MuonFilter::new(MuonConfig::default(), g.clone());
        let mut shuffled = MuonFilter::new(MuonConfig::default(), g.clone());
        let mut events = 0;
        for slice in 0..8 {
            let sorted = crate::generated_slice(&generator, slice);
            // Every other fragment with its hit records reversed (the waveforms after them
            // stay where they are).
            let mut reversed = sorted.clone();
            for f in reversed.fragments.iter_mut().step_by(2) {
                let n = f.hit_count as usize * shoal_core::hit::HIT_LEN;
                let mut b = BytesMut::from(&f.payload[..]);
                let (hits, _) = b.split_at_mut(n);
                hits.as_chunks_mut::<{ shoal_core::hit::HIT_LEN }>().0.reverse();
                f.payload = b.freeze();
            }
            assert!(reversed.fragments.iter().any(|f| !f.hit_records().is_sorted_by_key(Hit::from_record)));
            let expected = in_order.process_slice(&sorted);
            events += expected.len();
            assert_eq!(shuffled.process_slice(&reversed), expected, "slice {slice}");
        }
        assert!(events > 0, "the muons gave no event to compare");
        assert_eq!(in_order.stats, shuffled.stats);
    }

    #[test]
    fn a_muon_on_five_floors_fires_and_noise_alone_does_not() {
        let g = Geometry::antares(1, 30);
        let mut f = MuonFilter::new(MuonConfig::default(), g.clone());
        // A vertical muon along the string: pairs of hits on two OMs of floors 3..9, at the
        // times the light passes, plus isolated noise.
        let mut frags = Vec::new();
        for (m, module) in g.modules.iter().enumerate() {
            let mut hits = vec![Hit { time_ns: 50_000 + 37 * m as u32, channel: 0, amplitude: 10 }];
            if (3..10).contains(&m) {
                let t = 1_000_000 + (f64::from(30 - m as u32) * 14.5 / C_LIGHT) as u32;
                hits.push(Hit { time_ns: t, channel: 0, amplitude: 10 });
                hits.push(Hit { time_ns: t + 3, channel: 1, amplitude: 12 });
            }
            hits.sort_unstable();
            let mut b = BytesMut::new();
            for h in &hits {
                h.encode(&mut b);
            }
            let _ = module;
            frags.push(FragmentData { source: m as u32, flags: 0, hit_count: hits.len() as u32, payload: b.freeze() });
        }
        let slice = SliceData { slice: 1, slice_start_ns: 0, slice_ns: 10_000_000, fragments: frags.clone() };
        let ev = f.process_slice(&slice);
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].triggered_hits(), 14);
        assert!(ev[0].trigger_mask & TRIGGER_3D != 0);
        assert_eq!(ev[0].overlays, 0);
        // The same with the direction scan on.
        let mut f = MuonFilter::new(MuonConfig { direction_scan: true, ..Default::default() }, g.clone());
        let ev = f.process_slice(&slice);
        assert_eq!(ev.len(), 1);
        assert!(ev[0].trigger_mask & TRIGGER_3D_SCAN != 0);
        // Noise only: no event.
        let noise: Vec<FragmentData> = frags
            .iter()
            .map(|fr| {
                let mut b = BytesMut::new();
                Hit { time_ns: 50_000 + 37 * fr.source, channel: 0, amplitude: 10 }.encode(&mut b);
                FragmentData { source: fr.source, flags: 0, hit_count: 1, payload: b.freeze() }
            })
            .collect();
        assert!(
            f.process_slice(&SliceData { slice: 2, slice_start_ns: 0, slice_ns: 10_000_000, fragments: noise })
                .is_empty()
        );
    }
}
