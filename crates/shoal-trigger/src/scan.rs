//! The direction scan's confirmation of a causality cluster (step 3 of [`crate::muon`]),
//! made cheap without changing its answer.
//!
//! A cluster is confirmed if, for some direction of the grid, its members (a) are *dense*
//! along it: some window of `tau = t - z/c` (z along the direction) of width `tau_width`
//! holds `min_hits` of them, and (b) prune to a clique of `min_hits` on `min_modules`
//! modules under the road test. (a) is a necessary condition of (b), cheap beside it; on
//! KM3NeT-sized slices nearly every candidate fails (a) in every direction, so (a) is
//! what costs. Three things make it cheap:
//! - **The road in the count.** Members of a road clique are also at most `road_width_m`
//!   apart across the direction. The blocks count only such pairs: still a necessary
//!   condition of (b) (the clique's member of highest tau counts every other member), and
//!   one that rejects most directions of a cluster whose members are hundreds of metres
//!   apart in every direction but a few (the ARCA-sized bench: 25.7 -> 15.4 ms a slice).
//! - **Blocks of directions at once.** For [`LANES`] directions, each member's `tau` is
//!   computed into a row, and members are counted pair by pair (a window ending at member
//!   `i` holds every `j` with `tau_j <= tau_i` and `tau_i - tau_j <= width`): no sort, no
//!   branch, no division, and the compiler vectorises across the directions. Counting is
//!   the sorted sliding window's answer (`dense_sorted`) but for rounding, which a slack
//!   on the window covers: a block only ever passes too much, and a grid direction that
//!   passes is tested again exactly, with `dense_sorted`, before its clique.
//! - **A hierarchy of coarser grids.** The directions are grouped into cells around the
//!   directions of grids three, nine, ... times coarser. Between a cell's centre `u` and
//!   any direction `d` of it (`|d - u| <= chord`), two members' difference of `tau`
//!   changes by at most `|p_i - p_j| chord / c`, so if the members are not dense at `u`
//!   with the window widened by `diameter * chord / c`, they are dense nowhere in the
//!   cell, and the cell is skipped whole. Cells that pass are opened, down to the grid's
//!   own directions.
//!
//! [`DirectionScan::confirms`] returns what the scan over the flat grid returned; the tests
//! hold it against that reference on random clusters.

use shoal_detector::physics::C_LIGHT;

use crate::track::{CliqueScratch, Road, TriggerHit, causal_along, distance, distinct_modules, prune_to_clique};

/// Directions evaluated together.
pub const LANES: usize = 8;

/// Windows of blocks get this much more (ns), so that rounding (a product in place of the
/// exact test's quotient, ~1e-12 ns; taus of 1e8 ns, ~1e-8) never rejects what the exact
/// test at a grid direction would pass.
const BOUND_SLACK_NS: f64 = 1e-3;

/// Above this many members the pair count (members squared per direction) gives way to
/// the sorted window (members log members), which the road does not enter. With the road
/// in the count, the pairs pay for themselves well beyond a few tens of members: the first
/// 8 of km3net-testdata's triggered events (candidates of 45-180 members, 1-degree scan)
/// took 381 s of CPU with the sorted window above 48 members, 64 s with the count up to
/// this (the same triggers). The bound keeps a block's pairs to 33,000.
const PAIR_COUNT_MAX_MEMBERS: usize = 256;

/// One level of the hierarchy: directions (structure of arrays), each with the largest
/// distance from it to a grid direction of its cell (its chord, kept divided by c), and
/// (above the grid) its cell's range in the level below.
#[derive(Clone, Debug, Default)]
struct Level {
    x: Vec<f64>,
    y: Vec<f64>,
    z: Vec<f64>,
    /// `chord / c`: how much a pair's window widens per metre between them.
    spread: Vec<f64>,
    children: Vec<(u32, u32)>,
}

/// The grid of directions arranged for the scan (built once per filter).
#[derive(Clone, Debug, Default)]
pub struct DirectionScan {
    /// `levels[0]` is the grid itself (chord 0); the last the coarsest.
    levels: Vec<Level>,
}

/// The members of one candidate as the scan reads them.
#[derive(Debug, Default)]
struct Members {
    t: Vec<f64>,
    x: Vec<f64>,
    y: Vec<f64>,
    z: Vec<f64>,
}

/// The members relative to the first one, in f32, as [`dense_counted`] reads them: a
/// difference of tau is the same whatever the origin of time and space, and relative
/// values keep f32's rounding to hundredths of a nanosecond for a cluster a kilometre and
/// microseconds across, which [`Relative::rounding_slack`] puts on every window. Eight
/// directions of f32 are one AVX2 register where f64 took two.
#[derive(Debug, Default)]
struct Relative {
    t: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
    z: Vec<f32>,
    /// Largest `|t| + (|x| + |y| + |z|) / c` of a member (relative): what the rounding of
    /// its tau scales with.
    scale: f64,
    /// Largest distance between two members.
    diameter: f64,
    /// Largest `|x| + |y| + |z|` of a member (relative): what the rounding of its position
    /// along a direction scales with.
    reach: f64,
}

impl Relative {
    fn set(&mut self, m: &Members, distance: &[f64]) {
        let Self { t, x, y, z, scale, diameter, reach } = self;
        t.clear();
        x.clear();
        y.clear();
        z.clear();
        *scale = 0.0;
        *reach = 0.0;
        let Some(&t0) = m.t.first() else { return };
        let (x0, y0, z0) = (m.x[0], m.y[0], m.z[0]);
        for i in 0..m.t.len() {
            let r = [m.t[i] - t0, m.x[i] - x0, m.y[i] - y0, m.z[i] - z0];
            t.push(r[0] as f32);
            x.push(r[1] as f32);
            y.push(r[2] as f32);
            z.push(r[3] as f32);
            let spatial = r[1].abs() + r[2].abs() + r[3].abs();
            *scale = scale.max(r[0].abs() + spatial / C_LIGHT);
            *reach = reach.max(spatial);
        }
        *diameter = distance.iter().copied().fold(0.0, f64::max);
    }

    /// Most the f32 arithmetic of [`dense_counted`] can misplace a pair's difference of tau
    /// against its window (`width` plus `spread` per metre between them), twice over: each
    /// tau is a few roundings of at most `scale`, the window a few of its own size.
    fn rounding_slack(&self, width: f64, spread: f64) -> f64 {
        32.0 * f64::from(f32::EPSILON) * (2.0 * self.scale + width + self.diameter * spread)
    }

    /// Most the f32 arithmetic of [`dense_counted`] can misplace a pair's squared distance
    /// across a direction (`d^2 - (along_i - along_j)^2`), twice over.
    fn across_slack(&self) -> f64 {
        32.0 * f64::from(f32::EPSILON) * self.diameter * (self.diameter + self.reach)
    }
}

/// Reused buffers of [`DirectionScan::confirms`].
#[derive(Debug, Default)]
pub struct ScanScratch {
    members: Members,
    relative: Relative,
    /// Distance of every pair of members (`a < b`, in the order [`dense_counted`] visits them).
    distance: Vec<f64>,
    rows: Rows,
    sorted: Vec<f64>,
    core: CoreBuffers,
    /// The directions of one level still open, and of the level below.
    open: Vec<u32>,
    below: Vec<u32>,
    clique: Vec<usize>,
    pruning: CliqueScratch,
}

fn nearest(centres: &[[f64; 3]], d: [f64; 3]) -> usize {
    let dot = |c: &[f64; 3]| c[0] * d[0] + c[1] * d[1] + c[2] * d[2];
    (0..centres.len()).max_by(|&a, &b| dot(&centres[a]).total_cmp(&dot(&centres[b]))).unwrap_or(0)
}

impl DirectionScan {
    /// The scan over `grid` (any set of unit vectors), with cells around the directions of
    /// [`crate::track::direction_grid`] at three, nine, ... times `step_deg` up to 90 degrees.
    pub fn new(grid: &[[f64; 3]], step_deg: f64) -> Self {
        let mut coarse: Vec<Vec<[f64; 3]>> = Vec::new();
        let mut step = step_deg.clamp(0.5, 90.0) * 3.0;
        while step <= 90.0 {
            coarse.push(crate::track::direction_grid(step));
            step *= 3.0;
        }
        // Each grid direction's path: its nearest centre at every level, coarsest first;
        // sorted by path, the directions of one cell (one path prefix) are contiguous.
        let mut paths: Vec<(Vec<usize>, [f64; 3])> =
            grid.iter().map(|&d| (coarse.iter().rev().map(|c| nearest(c, d)).collect(), d)).collect();
        paths.sort_by(|a, b| a.0.cmp(&b.0));
        let mut levels = Vec::with_capacity(coarse.len() + 1);
        let mut fine = Level::default();
        for (_, d) in &paths {
            fine.x.push(d[0]);
            fine.y.push(d[1]);
            fine.z.push(d[2]);
            fine.spread.push(0.0);
        }
        levels.push(fine);
        // Level l's cells: runs of equal path prefixes of length (coarse.len() - l + 1);
        // their children: the runs one level down inside them.
        let depth = coarse.len();
        let mut below: Vec<(usize, usize)> = (0..paths.len()).map(|i| (i, i + 1)).collect();
        for l in 1..=depth {
            let prefix = depth - l + 1;
            let centres = &coarse[l - 1];
            let mut level = Level::default();
            let mut runs = Vec::new();
            let mut k = 0;
            while k < below.len() {
                let key = &paths[below[k].0].0[..prefix];
                let mut end = k + 1;
                while end < below.len() && &paths[below[end].0].0[..prefix] == key {
                    end += 1;
                }
                let centre = centres[key[prefix - 1]];
                let (first, last) = (below[k].0, below[end - 1].1);
                let reach = paths[first..last].iter().map(|(_, d)| distance(*d, centre)).fold(0.0, f64::max);
                level.x.push(centre[0]);
                level.y.push(centre[1]);
                level.z.push(centre[2]);
                level.spread.push(reach / C_LIGHT);
                level.children.push((k as u32, end as u32));
                runs.push((first, last));
                k = end;
            }
            levels.push(level);
            below = runs;
        }
        Self { levels }
    }

    /// Number of directions of the grid.
    pub fn len(&self) -> usize {
        self.levels.first().map_or(0, |l| l.x.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `members` (indices into `hits`) are confirmed by some direction of the grid.
    pub fn confirms(&self, hits: &[TriggerHit], members: &[usize], cfg: &Road, s: &mut ScanScratch) -> bool {
        let Some(top) = self.levels.last() else { return false };
        let width = cfg.road_time_ns();
        let m = &mut s.members;
        m.t.clear();
        m.x.clear();
        m.y.clear();
        m.z.clear();
        for &i in members {
            let h = &hits[i];
            m.t.push(h.t);
            m.x.push(h.pos[0]);
            m.y.push(h.pos[1]);
            m.z.push(h.pos[2]);
        }
        s.distance.clear();
        for a in 0..members.len() {
            for b in a + 1..members.len() {
                s.distance.push(distance(hits[members[a]].pos, hits[members[b]].pos));
            }
        }
        s.relative.set(&s.members, &s.distance);
        let diameter = s.relative.diameter;
        // Level by level, coarsest first: the open directions in full blocks, and the cells
        // of those that pass opened in the level below.
        let ScanScratch { members: m, relative, distance, rows, sorted, core, open, below, clique, pruning } = s;
        open.clear();
        open.extend(0..top.x.len() as u32);
        for l in (0..self.levels.len()).rev() {
            let level = &self.levels[l];
            below.clear();
            for block in open.chunks(LANES) {
                let mut b = Block::empty();
                for (lane, &k) in block.iter().enumerate() {
                    let k = k as usize;
                    b.dir[0][lane] = level.x[k];
                    b.dir[1][lane] = level.y[k];
                    b.dir[2][lane] = level.z[k];
                    b.width[lane] = width + BOUND_SLACK_NS;
                    b.spread[lane] = level.spread[k];
                }
                b.road = cfg.road_width_m;
                let dense = if members.len() <= PAIR_COUNT_MAX_MEMBERS {
                    dense_counted(relative, distance, &b, cfg.min_hits, rows)
                } else {
                    let mut out = [false; LANES];
                    for (lane, o) in out.iter_mut().enumerate().take(block.len()) {
                        let dir = [b.dir[0][lane], b.dir[1][lane], b.dir[2][lane]];
                        *o = dense_sorted(m, dir, b.width[lane] + diameter * b.spread[lane], cfg.min_hits, sorted);
                    }
                    out
                };
                for (&k, _) in block.iter().zip(dense).filter(|(_, dense)| *dense) {
                    let k = k as usize;
                    if l > 0 {
                        let (a, b) = level.children[k];
                        below.extend(a..b);
                        continue;
                    }
                    let dir = [level.x[k], level.y[k], level.z[k]];
                    // The block's test had slack; the scan's own test is this one.
                    if !dense_sorted(m, dir, width, cfg.min_hits, sorted) {
                        continue;
                    }
                    let bounds = (width + BOUND_SLACK_NS, cfg.road_width_m);
                    clique_candidates(m, members, dir, bounds, cfg.min_hits, core, clique);
                    let related =
                        |a: usize, b: usize| causal_along(&hits[a], &hits[b], dir, cfg.road_width_m, cfg.t_extra_ns);
                    prune_to_clique(clique, related, pruning);
                    if clique.len() >= cfg.min_hits && distinct_modules(hits, clique) >= cfg.min_modules {
                        return true;
                    }
                }
            }
            std::mem::swap(open, below);
        }
        false
    }
}

/// Buffers of [`clique_candidates`].
#[derive(Debug, Default)]
struct CoreBuffers {
    /// Members by tau: (tau, member).
    order: Vec<(f64, u32)>,
    /// Pairs that may be related, and each member's count of them.
    pairs: Vec<(u32, u32)>,
    degree: Vec<u32>,
    /// The pairs by member (`first[i]..first[i + 1]` of `neighbours`).
    first: Vec<u32>,
    fill: Vec<u32>,
    neighbours: Vec<u32>,
    alive: Vec<bool>,
    low: Vec<u32>,
}

/// The members (indices into `hits`, as `members`) that can be in a clique of `min_hits`
/// under the road test along `dir`, in `out`, in their order.
///
/// Two members related by the road test are at most `road_width_m` apart across `dir` and
/// have taus within the scan's window of each other (`width`; both bounds with slack for
/// rounding). Under that looser relation, members are peeled while one has fewer than
/// `min_hits - 1` partners: what is left holds the graph's (`min_hits - 1`)-core under the
/// road test. The greedy pruning never removes a core member while a member of lower degree
/// is left, so it reaches the core (if there is one) whatever it removed first, and from
/// there goes on the same way: started from what is left it ends in the same clique. A
/// bright event has hundreds of members, dense along thousands of the 1-degree grid's
/// directions: this costs a pass over the pairs close in tau, the pruning members squared
/// road tests and as many steps again.
fn clique_candidates(
    m: &Members,
    members: &[usize],
    dir: [f64; 3],
    (width, road): (f64, f64),
    min_hits: usize,
    buf: &mut CoreBuffers,
    out: &mut Vec<usize>,
) {
    let CoreBuffers { order, pairs, degree, first, fill, neighbours, alive, low } = buf;
    let k = members.len();
    let need = min_hits.saturating_sub(1) as u32;
    order.clear();
    order.extend((0..k).map(|i| (tau(m, i, dir), i as u32)));
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    let road2 = road * road * (1.0 + 1e-9) + 1e-9;
    pairs.clear();
    degree.clear();
    degree.resize(k, 0);
    for p in 0..k {
        let (tp, a) = (order[p].0, order[p].1 as usize);
        for &(tq, b) in &order[p + 1..] {
            if tq - tp > width {
                break;
            }
            let b = b as usize;
            let d = [m.x[b] - m.x[a], m.y[b] - m.y[a], m.z[b] - m.z[a]];
            let dz = d[0] * dir[0] + d[1] * dir[1] + d[2] * dir[2];
            if d[0] * d[0] + d[1] * d[1] + d[2] * d[2] - dz * dz <= road2 {
                pairs.push((a as u32, b as u32));
                degree[a] += 1;
                degree[b] += 1;
            }
        }
    }
    // Each member's partners, then the peeling.
    first.clear();
    first.push(0);
    for &d in degree.iter() {
        first.push(first.last().copied().unwrap_or(0) + d);
    }
    neighbours.clear();
    neighbours.resize(pairs.len() * 2, 0);
    fill.clear();
    fill.extend_from_slice(&first[..k]);
    for &(a, b) in pairs.iter() {
        neighbours[fill[a as usize] as usize] = b;
        fill[a as usize] += 1;
        neighbours[fill[b as usize] as usize] = a;
        fill[b as usize] += 1;
    }
    alive.clear();
    alive.resize(k, true);
    low.clear();
    low.extend((0..k as u32).filter(|&i| degree[i as usize] < need));
    while let Some(i) = low.pop() {
        let i = i as usize;
        if !alive[i] {
            continue;
        }
        alive[i] = false;
        for &j in &neighbours[first[i] as usize..first[i + 1] as usize] {
            let j = j as usize;
            if alive[j] {
                degree[j] -= 1;
                if degree[j] + 1 == need {
                    low.push(j as u32);
                }
            }
        }
    }
    out.clear();
    out.extend(members.iter().zip(alive.iter()).filter(|(_, a)| **a).map(|(&i, _)| i));
}

/// `tau` of a member along `dir`: its time less the light's travel along `dir`.
fn tau(m: &Members, i: usize, dir: [f64; 3]) -> f64 {
    m.t[i] - (m.x[i] * dir[0] + m.y[i] * dir[1] + m.z[i] * dir[2]) / C_LIGHT
}

/// Whether some window of `tau` of width `width` holds `min_hits` members: sorted, with a
/// sliding window (the scan's original test, and the reference of [`dense_counted`]).
fn dense_sorted(m: &Members, dir: [f64; 3], width: f64, min_hits: usize, sorted: &mut Vec<f64>) -> bool {
    sorted.clear();
    sorted.extend((0..m.t.len()).map(|i| tau(m, i, dir)));
    sorted.sort_by(f64::total_cmp);
    let mut lo = 0;
    (0..sorted.len()).any(|hi| {
        while sorted[hi] - sorted[lo] > width {
            lo += 1;
        }
        hi + 1 - lo >= min_hits
    })
}

/// [`LANES`] directions and the window each is tested with.
#[derive(Clone, Copy, Debug)]
struct Block {
    /// `dir[axis][lane]`.
    dir: [[f64; LANES]; 3],
    /// The window; NaN in lanes without a direction (they count nothing).
    width: [f64; LANES],
    /// A cell's chord / c (0 at the grid's own directions): a pair's window is widened by
    /// its distance times this.
    spread: [f64; LANES],
    /// The road's width (m; infinite: no bound across the direction). A pair counts only
    /// if it is at most this far apart across the direction, widened by its distance times
    /// the cell's chord (how far a direction of the cell can turn the pair).
    road: f64,
}

impl Block {
    fn empty() -> Self {
        Self { dir: [[0.0; LANES]; 3], width: [f64::NAN; LANES], spread: [0.0; LANES], road: f64::INFINITY }
    }
}

/// Rows of [`dense_counted`]: one per member, a lane per direction.
#[derive(Debug, Default)]
struct Rows {
    tau: Vec<[f32; LANES]>,
    /// Position along each direction, m.
    along: Vec<[f32; LANES]>,
    count: Vec<[f32; LANES]>,
}

/// [`dense_sorted`] for a block of directions at once: member `i` counts the members `j`
/// with `tau_j <= tau_i` and `tau_i - tau_j <= width + distance_ij * spread` (itself
/// included) that are at most `road + distance_ij * chord` apart across the direction
/// (`chord = spread * c`; with an infinite road, every member); dense where some count
/// reaches `min_hits`. `distance` holds the pairs' distances, `i < j`, in that order.
///
/// With `spread` 0 and no road, the answer of [`dense_sorted`] but for rounding (taus here
/// are f32, relative to the first member, computed with a product, not a quotient; each
/// window gets [`Relative::rounding_slack`] more, so the count only ever passes too much):
/// the member of a window's highest f32 tau counts every member of it. At a cell's centre
/// each pair's window is widened by the most the cell's directions can move that pair
/// apart, so members dense somewhere in the cell are counted dense at its centre; and a
/// road clique of a direction `d` of the cell is counted dense at its centre `u`, since a
/// pair's separation across the direction changes by at most `|p_i - p_j| |u - d|`.
fn dense_counted(m: &Relative, distance: &[f64], block: &Block, min_hits: usize, rows: &mut Rows) -> [bool; LANES] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[allow(unsafe_code)]
        // SAFETY: this CPU has AVX2, checked just above.
        return unsafe { dense_counted_avx2(m, distance, block, min_hits, rows) };
    }
    dense_counted_portable(m, distance, block, min_hits, rows)
}

/// [`dense_counted_portable`] compiled for AVX2: eight lanes per instruction instead of
/// SSE2's four. The same operations in the same order (no fused multiply-add): the same
/// bits. (An AVX-512 build measured no faster on this machine.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dense_counted_avx2(
    m: &Relative,
    distance: &[f64],
    block: &Block,
    min_hits: usize,
    rows: &mut Rows,
) -> [bool; LANES] {
    dense_counted_portable(m, distance, block, min_hits, rows)
}

/// One pair of members in every lane: each counts the other if within its window below.
/// Branch-free over fixed-size arrays passed apart (not through the block), which is what
/// lets the compiler keep it in vector instructions.
#[inline(always)]
fn count_pair(
    (ti, tj): (&[f32; LANES], &[f32; LANES]),
    (ai, aj): (&[f32; LANES], &[f32; LANES]),
    lanes: &Lanes,
    dij: f32,
    ci: &mut [f32; LANES],
    cj: &mut [f32; LANES],
) {
    let across_limit = dij * dij - lanes.across_slack;
    for lane in 0..LANES {
        // tau_j - tau_i is exactly -(tau_i - tau_j): one subtraction serves both.
        let diff = ti[lane] - tj[lane];
        let limit = lanes.width[lane] + dij * lanes.spread[lane];
        // Across the direction: d^2 - (along_i - along_j)^2 <= (road + d chord)^2.
        let da = ai[lane] - aj[lane];
        let road = lanes.road + dij * lanes.chord[lane];
        let near = across_limit - da * da <= road * road;
        // Counted in f32, the compares' own width, so the lanes stay vectors.
        ci[lane] += if (diff >= 0.0) & (diff <= limit) & near { 1.0 } else { 0.0 };
        cj[lane] += if (diff <= 0.0) & (diff >= -limit) & near { 1.0 } else { 0.0 };
    }
}

/// A block's bounds in f32, each with its rounding slack on it.
struct Lanes {
    width: [f32; LANES],
    spread: [f32; LANES],
    /// The cell's chord (`spread * c`), widened by a few roundings.
    chord: [f32; LANES],
    road: f32,
    across_slack: f32,
}

#[inline(always)]
fn dense_counted_portable(
    m: &Relative,
    distance: &[f64],
    block: &Block,
    min_hits: usize,
    rows: &mut Rows,
) -> [bool; LANES] {
    let Rows { tau, along, count } = rows;
    let k = m.t.len();
    tau.clear();
    along.clear();
    count.clear();
    let dir = block.dir.map(|axis| axis.map(|c| c as f32));
    // The products below are a few roundings off; (1 + 16 eps)^2 covers them.
    let widen = 1.0 + 16.0 * f64::from(f32::EPSILON);
    let mut lanes = Lanes {
        width: [0.0; LANES],
        spread: [0.0; LANES],
        chord: [0.0; LANES],
        road: (block.road * widen) as f32,
        across_slack: m.across_slack() as f32,
    };
    for lane in 0..LANES {
        let (w, s) = (block.width[lane], block.spread[lane]);
        lanes.width[lane] = (w + m.rounding_slack(w, s)) as f32;
        lanes.spread[lane] = s as f32;
        lanes.chord[lane] = (s * C_LIGHT * widen) as f32;
    }
    let per_c = (1.0 / C_LIGHT) as f32;
    for i in 0..k {
        let mut row = [0.0; LANES];
        let mut pos = [0.0; LANES];
        for lane in 0..LANES {
            // `tau()` with a product for the quotient: the window's slack covers the
            // difference, and the exact test follows where a grid direction passes.
            pos[lane] = m.x[i] * dir[0][lane] + m.y[i] * dir[1][lane] + m.z[i] * dir[2][lane];
            row[lane] = m.t[i] - pos[lane] * per_c;
        }
        tau.push(row);
        along.push(pos);
        count.push([1.0; LANES]);
    }
    let mut pair = 0;
    for i in 0..k {
        let (head, tail) = count.split_at_mut(i + 1);
        // Member i's count in registers through the row (through the slice, each pair
        // waited on the last one's store).
        let mut ci = head[i];
        let (ti, ai) = (&tau[i], &along[i]);
        for ((cj, tj), aj) in tail.iter_mut().zip(&tau[i + 1..]).zip(&along[i + 1..]) {
            count_pair((ti, tj), (ai, aj), &lanes, distance[pair] as f32, &mut ci, cj);
            pair += 1;
        }
        head[i] = ci;
    }
    let mut out = [false; LANES];
    for c in count.iter() {
        for lane in 0..LANES {
            out[lane] |= c[lane] >= min_hits as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::track::{DEFAULT_SCAN_STEP_DEG, direction_grid, tan_cherenkov};
    use proptest::prelude::*;

    /// The scan as it was: every direction of the flat grid in turn, sorted window, then
    /// the clique.
    fn flat_scan(hits: &[TriggerHit], members: &[usize], cfg: &Road, grid: &[[f64; 3]]) -> bool {
        let width = cfg.road_time_ns();
        let mut m = Members::default();
        for &i in members {
            m.t.push(hits[i].t);
            m.x.push(hits[i].pos[0]);
            m.y.push(hits[i].pos[1]);
            m.z.push(hits[i].pos[2]);
        }
        let mut sorted = Vec::new();
        grid.iter().any(|&dir| {
            if !dense_sorted(&m, dir, width, cfg.min_hits, &mut sorted) {
                return false;
            }
            let mut c = members.to_vec();
            let related = |a: usize, b: usize| causal_along(&hits[a], &hits[b], dir, cfg.road_width_m, cfg.t_extra_ns);
            prune_to_clique(&mut c, related, &mut CliqueScratch::default());
            c.len() >= cfg.min_hits && distinct_modules(hits, &c) >= cfg.min_modules
        })
    }

    fn members(raw: &[(f64, f64, f64, f64)]) -> Members {
        let mut m = Members::default();
        for &(t, x, y, z) in raw {
            m.t.push(t);
            m.x.push(x);
            m.y.push(y);
            m.z.push(z);
        }
        m
    }

    /// A track along `dir` through the origin: hits on modules spread around it, at the
    /// times the Cherenkov light reaches them (plus `jitter`), and background hits.
    fn track(dir: [f64; 3], on_track: usize, background: &[(f64, [f64; 3])], jitter: &[f64]) -> Vec<TriggerHit> {
        let tan_c = tan_cherenkov();
        let perp = if dir[2].abs() < 0.9 { [0.0, 0.0, 1.0] } else { [1.0, 0.0, 0.0] };
        // a unit vector across the track
        let dot = perp[0] * dir[0] + perp[1] * dir[1] + perp[2] * dir[2];
        let mut q = [perp[0] - dot * dir[0], perp[1] - dot * dir[1], perp[2] - dot * dir[2]];
        let n = (q[0] * q[0] + q[1] * q[1] + q[2] * q[2]).sqrt();
        q = [q[0] / n, q[1] / n, q[2] / n];
        let mut hits: Vec<TriggerHit> = (0..on_track)
            .map(|k| {
                let z = -200.0 + 400.0 * k as f64 / on_track.max(1) as f64;
                let r = 5.0 + 30.0 * ((k * 7) % 5) as f64 / 5.0;
                let pos = [z * dir[0] + r * q[0], z * dir[1] + r * q[1], z * dir[2] + r * q[2]];
                let t = 1_000.0 + z / C_LIGHT + r * tan_c / C_LIGHT + jitter.get(k).copied().unwrap_or(0.0);
                TriggerHit { t, pos, module: k, hit: k, hit_end: k + 1 }
            })
            .collect();
        for (k, &(t, pos)) in background.iter().enumerate() {
            hits.push(TriggerHit { t, pos, module: on_track + k, hit: 0, hit_end: 1 });
        }
        hits.sort_by(|a, b| a.t.total_cmp(&b.t));
        hits
    }

    #[test]
    fn every_grid_direction_is_in_exactly_one_cell_within_its_chord() {
        for step in [10.0, 5.0, 1.0] {
            let grid = direction_grid(step);
            let scan = DirectionScan::new(&grid, step);
            assert_eq!(scan.len(), grid.len());
            assert!(scan.levels.len() >= 2, "{step}: at least one coarse level");
            // Every direction of the grid appears once at level 0.
            let mut seen: Vec<[u64; 3]> = (0..scan.len())
                .map(|k| [scan.levels[0].x[k], scan.levels[0].y[k], scan.levels[0].z[k]].map(f64::to_bits))
                .collect();
            seen.sort_unstable();
            let mut want: Vec<[u64; 3]> = grid.iter().map(|d| d.map(f64::to_bits)).collect();
            want.sort_unstable();
            assert_eq!(seen, want, "{step}");
            // Each cell's children tile the level below, and every grid direction under a
            // cell is within its chord of the cell's centre.
            for l in 1..scan.levels.len() {
                let level = &scan.levels[l];
                let mut next = 0;
                for (c, &(a, b)) in level.children.iter().enumerate() {
                    assert_eq!(a, next, "{step} level {l}");
                    assert!(b > a);
                    next = b;
                    let centre = [level.x[c], level.y[c], level.z[c]];
                    let mut stack = vec![(l - 1, a, b)];
                    while let Some((ll, a, b)) = stack.pop() {
                        for k in a..b {
                            if ll == 0 {
                                let d = [
                                    scan.levels[0].x[k as usize],
                                    scan.levels[0].y[k as usize],
                                    scan.levels[0].z[k as usize],
                                ];
                                assert!(distance(d, centre) / C_LIGHT <= level.spread[c], "{step} level {l}");
                            } else {
                                let (ca, cb) = scan.levels[ll].children[k as usize];
                                stack.push((ll - 1, ca, cb));
                            }
                        }
                    }
                }
                assert_eq!(next as usize, scan.levels[l - 1].x.len(), "{step} level {l}");
            }
        }
    }

    #[test]
    fn a_track_is_confirmed_and_its_hits_spread_in_time_are_not() {
        let cfg = Road::default();
        let dir = {
            let (th, ph) = (0.7f64, 2.1f64);
            [th.sin() * ph.cos(), th.sin() * ph.sin(), th.cos()]
        };
        let grid = direction_grid(DEFAULT_SCAN_STEP_DEG);
        let scan = DirectionScan::new(&grid, DEFAULT_SCAN_STEP_DEG);
        let mut s = ScanScratch::default();
        // A few members (the pair count) and more than it takes (the sorted window).
        for n in [8, PAIR_COUNT_MAX_MEMBERS + 40] {
            let hits = track(dir, n, &[], &[]);
            let all: Vec<usize> = (0..hits.len()).collect();
            assert!(flat_scan(&hits, &all, &cfg, &grid), "{n}");
            assert!(scan.confirms(&hits, &all, &cfg, &mut s), "{n}");
            // The same hits each 300 ns after the last: dense nowhere.
            let jitter: Vec<f64> = (0..n).map(|k| 300.0 * k as f64).collect();
            let hits = track(dir, n, &[], &jitter);
            assert!(!flat_scan(&hits, &all, &cfg, &grid), "{n}");
            assert!(!scan.confirms(&hits, &all, &cfg, &mut s), "{n}");
        }
    }

    #[test]
    fn the_road_bounds_pairs_across_the_direction_widened_by_the_chord() {
        // Two members at the same time, 30 m apart across z: equal taus along z.
        let s = 30.0;
        let m = members(&[(100.0, 0.0, 0.0, 0.0), (100.0, s, 0.0, 0.0)]);
        let distance = vec![s];
        let mut rel = Relative::default();
        rel.set(&m, &distance);
        let dense = |road: f64, chord: f64| {
            let mut b = Block::empty();
            b.dir[2] = [1.0; LANES];
            b.width = [10.0; LANES];
            b.spread = [chord / C_LIGHT; LANES];
            b.road = road;
            dense_counted(&rel, &distance, &b, 2, &mut Rows::default())[0]
        };
        assert!(dense(f64::INFINITY, 0.0));
        assert!(dense(s * (1.0 + 1e-6), 0.0), "just within the road");
        assert!(!dense(s * 0.99, 0.0), "just beyond it");
        // A cell of chord 0.1: a direction of it can turn the pair by 0.1 * 30 m.
        assert!(dense(s * 0.91, 0.1));
        assert!(!dense(s * 0.89, 0.1));
    }

    proptest! {
        #[test]
        fn the_pair_count_is_the_sorted_window_but_for_rounding(
            raw in proptest::collection::vec((0.0f64..2000.0, -300.0f64..300.0, -300.0f64..300.0, -300.0f64..300.0), 1..20),
            dirs in proptest::collection::vec((0.0f64..std::f64::consts::PI, 0.0f64..std::f64::consts::TAU), LANES),
            widths in proptest::collection::vec(prop_oneof![Just(0.0), 0.0f64..800.0], LANES),
            min_hits in 1usize..8, ties in any::<bool>(),
        ) {
            let mut raw = raw;
            if ties {
                // Equal times on one spot: equal taus in every direction.
                let first = raw[0];
                for r in raw.iter_mut().step_by(2) {
                    *r = first;
                }
            }
            let m = members(&raw);
            let mut b = Block::empty();
            for (lane, &(th, ph)) in dirs.iter().enumerate() {
                b.dir[0][lane] = th.sin() * ph.cos();
                b.dir[1][lane] = th.sin() * ph.sin();
                b.dir[2][lane] = th.cos();
            }
            let widths: [f64; LANES] = widths.clone().try_into().unwrap();
            // With no spread the distances do not matter.
            let distance = vec![123.0; m.t.len() * m.t.len()];
            let mut rel = Relative::default();
            rel.set(&m, &distance);
            // Dense by the exact test at a width: counted dense with the slack on it; and
            // counted dense at a width: dense by the exact test with the slack on it.
            b.width = widths.map(|w| w + BOUND_SLACK_NS);
            let with_slack = dense_counted(&rel, &distance, &b, min_hits, &mut Rows::default());
            b.width = widths;
            let without = dense_counted(&rel, &distance, &b, min_hits, &mut Rows::default());
            for lane in 0..LANES {
                let dir = [b.dir[0][lane], b.dir[1][lane], b.dir[2][lane]];
                if dense_sorted(&m, dir, widths[lane], min_hits, &mut Vec::new()) {
                    prop_assert!(with_slack[lane], "lane {}", lane);
                }
                // The count passes too much by at most its rounding slack.
                if without[lane] {
                    let most = widths[lane] + BOUND_SLACK_NS + rel.rounding_slack(widths[lane], 0.0);
                    prop_assert!(dense_sorted(&m, dir, most, min_hits, &mut Vec::new()), "lane {}", lane);
                }
            }
        }

        #[test]
        fn members_dense_somewhere_in_a_cell_are_counted_dense_at_its_centre(
            raw in proptest::collection::vec((0.0f64..1500.0, -300.0f64..300.0, -300.0f64..300.0, -300.0f64..300.0), 1..16),
            centre in (0.0f64..std::f64::consts::PI, 0.0f64..std::f64::consts::TAU),
            offset in (-0.4f64..0.4, -0.4f64..0.4),
            width in 0.0f64..400.0, min_hits in 1usize..7,
        ) {
            let m = members(&raw);
            let unit = |th: f64, ph: f64| [th.sin() * ph.cos(), th.sin() * ph.sin(), th.cos()];
            let u = unit(centre.0, centre.1);
            let d = unit(centre.0 + offset.0, centre.1 + offset.1);
            let mut sorted = Vec::new();
            prop_assume!(dense_sorted(&m, d, width, min_hits, &mut sorted));
            let mut distance = Vec::new();
            for a in 0..raw.len() {
                for c in a + 1..raw.len() {
                    distance.push(super::distance([m.x[a], m.y[a], m.z[a]], [m.x[c], m.y[c], m.z[c]]));
                }
            }
            let mut b = Block::empty();
            b.dir = [[u[0]; LANES], [u[1]; LANES], [u[2]; LANES]];
            b.width = [width + BOUND_SLACK_NS; LANES];
            b.spread = [super::distance(u, d) / C_LIGHT; LANES];
            let mut rel = Relative::default();
            rel.set(&m, &distance);
            prop_assert!(dense_counted(&rel, &distance, &b, min_hits, &mut Rows::default())[0]);
        }

        #[test]
        fn a_road_clique_somewhere_in_a_cell_is_counted_dense_at_its_centre(
            theta in 0.0f64..std::f64::consts::PI, phi in 0.0f64..std::f64::consts::TAU,
            offset in (-0.3f64..0.3, -0.3f64..0.3),
            on_track in 6usize..12,
            jitter in proptest::collection::vec(-10.0f64..10.0, 12),
            background in proptest::collection::vec((0.0f64..3000.0, -250.0f64..250.0, -250.0f64..250.0, -250.0f64..250.0), 0..8),
            min_hits in 3usize..6, road in prop_oneof![Just(43.0), 12.0f64..80.0],
        ) {
            // Hits along d; the block is at u, a direction of d's cell.
            let unit = |th: f64, ph: f64| [th.sin() * ph.cos(), th.sin() * ph.sin(), th.cos()];
            let d = unit(theta + offset.0, phi + offset.1);
            let u = unit(theta, phi);
            let bg: Vec<(f64, [f64; 3])> = background.iter().map(|&(t, x, y, z)| (t, [x, y, z])).collect();
            let hits = track(d, on_track, &bg, &jitter);
            let cfg = Road { road_width_m: road, ..Default::default() };
            let mut clique: Vec<usize> = (0..hits.len()).collect();
            let related = |a: usize, b: usize| causal_along(&hits[a], &hits[b], d, cfg.road_width_m, cfg.t_extra_ns);
            prune_to_clique(&mut clique, related, &mut CliqueScratch::default());
            prop_assume!(clique.len() >= min_hits);
            let mut m = Members::default();
            for h in &hits {
                m.t.push(h.t);
                m.x.push(h.pos[0]);
                m.y.push(h.pos[1]);
                m.z.push(h.pos[2]);
            }
            let mut distance = Vec::new();
            for a in 0..hits.len() {
                for c in a + 1..hits.len() {
                    distance.push(super::distance(hits[a].pos, hits[c].pos));
                }
            }
            let mut rel = Relative::default();
            rel.set(&m, &distance);
            let mut b = Block::empty();
            b.dir = [[u[0]; LANES], [u[1]; LANES], [u[2]; LANES]];
            b.width = [cfg.road_time_ns() + BOUND_SLACK_NS; LANES];
            b.spread = [super::distance(u, d) / C_LIGHT; LANES];
            b.road = road;
            prop_assert!(dense_counted(&rel, &distance, &b, min_hits, &mut Rows::default())[0]);
        }

        #[test]
        fn the_hierarchical_scan_confirms_what_the_flat_scan_confirms(
            theta in 0.0f64..std::f64::consts::PI, phi in 0.0f64..std::f64::consts::TAU,
            on_track in 0usize..9,
            jitter in proptest::collection::vec(-60.0f64..60.0, 9),
            background in proptest::collection::vec((0.0f64..3000.0, -250.0f64..250.0, -250.0f64..250.0, -250.0f64..250.0), 0..8),
            min_hits in 3usize..7, road in prop_oneof![Just(43.0), 10.0f64..80.0], step in prop_oneof![Just(10.0), Just(5.0), 3.0f64..30.0],
        ) {
            let dir = [theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()];
            let bg: Vec<(f64, [f64; 3])> = background.iter().map(|&(t, x, y, z)| (t, [x, y, z])).collect();
            let hits = track(dir, on_track, &bg, &jitter);
            let cfg = Road { min_hits, min_modules: min_hits, road_width_m: road, ..Default::default() };
            let grid = direction_grid(step);
            let scan = DirectionScan::new(&grid, step);
            let all: Vec<usize> = (0..hits.len()).collect();
            prop_assert_eq!(scan.confirms(&hits, &all, &cfg, &mut ScanScratch::default()), flat_scan(&hits, &all, &cfg, &grid));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Bright candidates: tens of members, dense in many directions, where the clique's
        /// candidates leave members out and counts give way to sorting.
        #[test]
        fn bright_candidates_are_confirmed_as_by_the_flat_scan(
            theta in 0.0f64..std::f64::consts::PI, phi in 0.0f64..std::f64::consts::TAU,
            on_track in 10usize..40,
            jitter in proptest::collection::vec(prop_oneof![-30.0f64..30.0, -400.0f64..400.0], 40),
            background in proptest::collection::vec((0.0f64..3000.0, -250.0f64..250.0, -250.0f64..250.0, -250.0f64..250.0), 0..30),
            min_hits in 4usize..30, step in 6.0f64..15.0,
        ) {
            let dir = [theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()];
            let bg: Vec<(f64, [f64; 3])> = background.iter().map(|&(t, x, y, z)| (t, [x, y, z])).collect();
            let hits = track(dir, on_track, &bg, &jitter);
            let cfg = Road { min_hits, min_modules: min_hits, ..Default::default() };
            let grid = direction_grid(step);
            let scan = DirectionScan::new(&grid, step);
            let all: Vec<usize> = (0..hits.len()).collect();
            prop_assert_eq!(scan.confirms(&hits, &all, &cfg, &mut ScanScratch::default()), flat_scan(&hits, &all, &cfg, &grid));
        }
    }
}
