//! The geometry of a muon track as the trigger tests it: trigger hits, the causality and
//! road relations, the greedy clique pruning, direction grids. Below both the cluster
//! trigger ([`crate::muon`]) and its direction scan ([`crate::scan`]).

use shoal_detector::physics::{C_LIGHT, N_WATER, cherenkov_angle};

/// The direction scan's grid step when none is configured, degrees (ORCA's 10).
pub const DEFAULT_SCAN_STEP_DEG: f64 = 10.0;

/// What a cluster must satisfy along a direction: the road test's width and time slack,
/// and the size of the clique it must keep (`crate::muon::MuonConfig::road`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Road {
    /// Widest transverse distance from the track, m.
    pub road_width_m: f64,
    /// Added to the light-travel time, ns.
    pub t_extra_ns: f64,
    pub min_hits: usize,
    pub min_modules: usize,
}

impl Default for Road {
    fn default() -> Self {
        Self { road_width_m: 43.0, t_extra_ns: 20.0, min_hits: 5, min_modules: 5 }
    }
}

impl Road {
    /// The road test's widest time window, ns: `road_width_m tan(theta_c) / c + t_extra`
    /// (a pair's bound beyond the light's travel, and the direction scan's window in tau).
    pub fn road_time_ns(&self) -> f64 {
        self.road_width_m * tan_cherenkov() / C_LIGHT + self.t_extra_ns
    }
}

/// A merged local coincidence: the input of the cluster trigger.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TriggerHit {
    /// Calibrated time, ns since the slice start.
    pub t: f64,
    pub pos: [f64; 3],
    /// Index of the module (fragment) and of its first hit.
    pub module: usize,
    pub hit: usize,
    /// The L1 hits merged into it: `hit..hit_end` of that module's hits.
    pub hit_end: usize,
}

/// Euclidean distance (between positions, or between unit vectors: their chord).
pub fn distance(a: [f64; 3], b: [f64; 3]) -> f64 {
    ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)).sqrt()
}

/// tan of the Cherenkov angle, computed once (the road test asks for it per pair).
pub fn tan_cherenkov() -> f64 {
    static TAN: std::sync::LazyLock<f64> = std::sync::LazyLock::new(|| cherenkov_angle().tan());
    *TAN
}

/// The plain 3D causality relation.
pub fn causal(a: &TriggerHit, b: &TriggerHit, t_extra: f64) -> bool {
    (a.t - b.t).abs() <= distance(a.pos, b.pos) * N_WATER / C_LIGHT + t_extra
}

/// The road test along unit direction `dir`.
pub fn causal_along(a: &TriggerHit, b: &TriggerHit, dir: [f64; 3], road: f64, t_extra: f64) -> bool {
    let d = [b.pos[0] - a.pos[0], b.pos[1] - a.pos[1], b.pos[2] - a.pos[2]];
    let dz = d[0] * dir[0] + d[1] * dir[1] + d[2] * dir[2];
    let r2 = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2] - dz * dz).max(0.0);
    let r = r2.sqrt();
    if r > road {
        return false;
    }
    let tau = (b.t - a.t - dz / C_LIGHT).abs();
    tau <= r * tan_cherenkov() / C_LIGHT + t_extra
}

/// Buffers of [`prune_to_clique`], kept between calls (it runs for every candidate).
#[derive(Debug, Default)]
pub struct CliqueScratch {
    counts: Vec<usize>,
    rel: Vec<bool>,
    alive: Vec<bool>,
}

/// Greedy clique pruning: removes the member with the fewest relations (the latest on
/// ties) until all remaining members are related. `related(i, j)` over `members` indices.
pub fn prune_to_clique(members: &mut Vec<usize>, related: impl Fn(usize, usize) -> bool, s: &mut CliqueScratch) {
    let k = members.len();
    let CliqueScratch { counts, rel, alive } = s;
    counts.clear();
    counts.resize(k, 0);
    rel.clear();
    rel.resize(k * k, false);
    alive.clear();
    alive.resize(k, true);
    for a in 0..k {
        for b in a + 1..k {
            if related(members[a], members[b]) {
                rel[a * k + b] = true;
                rel[b * k + a] = true;
                counts[a] += 1;
                counts[b] += 1;
            }
        }
    }
    let mut size = k;
    loop {
        // The live member with the fewest relations; the latest (highest index) on ties.
        let mut worst = usize::MAX;
        for a in 0..k {
            if alive[a] && (worst == usize::MAX || counts[a] <= counts[worst]) {
                worst = a;
            }
        }
        if worst == usize::MAX || counts[worst] + 1 >= size {
            break;
        }
        alive[worst] = false;
        size -= 1;
        for b in 0..k {
            if alive[b] && rel[worst * k + b] {
                counts[b] -= 1;
            }
        }
    }
    let mut i = 0;
    members.retain(|_| {
        let keep = alive[i];
        i += 1;
        keep
    });
}

/// Unit vectors of a grid of directions covering the sphere with about `step_deg` spacing.
pub fn direction_grid(step_deg: f64) -> Vec<[f64; 3]> {
    let step = step_deg.clamp(0.5, 90.0).to_radians();
    let mut out = Vec::new();
    let n_theta = (std::f64::consts::PI / step).round().max(1.0) as usize;
    for i in 0..=n_theta {
        let theta = std::f64::consts::PI * i as f64 / n_theta as f64;
        let n_phi = ((2.0 * std::f64::consts::PI * theta.sin()) / step).round().max(1.0) as usize;
        for j in 0..n_phi {
            let phi = 2.0 * std::f64::consts::PI * j as f64 / n_phi as f64;
            out.push([theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()]);
        }
    }
    out
}

pub(crate) fn distinct_modules(hits: &[TriggerHit], members: &[usize]) -> usize {
    // Clusters are mostly a handful of hits: comparing with the ones before beats sorting
    // a fresh list; large ones are sorted.
    if members.len() <= 32 {
        return (0..members.len())
            .filter(|&a| !members[..a].iter().any(|&b| hits[b].module == hits[members[a]].module))
            .count();
    }
    let mut m: Vec<usize> = members.iter().map(|&i| hits[i].module).collect();
    m.sort_unstable();
    m.dedup();
    m.len()
}
