//! Detector geometry: modules (an ANTARES floor or a KM3NeT DOM, one front-end board, one
//! shoal source) holding PMTs with position, pointing direction and time offset.
//!
//! - [`Geometry::antares`]: the ANTARES-like reference of domain.md: strings of 30 floors,
//!   14.5 m apart (first floor 100 m above the sea bed), 3 OMs per floor looking 45 degrees
//!   down, strings on a grid about 70 m apart. 10 strings = 300 modules = 900 PMTs.
//! - [`Geometry::from_detx`]: a KM3NeT `.detx` file (formats v1 to v5), PMT positions,
//!   directions and time offsets as calibrated.
//!
//! Module index `i` is source id `i`; channel `c` of a hit is PMT `c` of its module.

use std::collections::HashMap;

/// One photomultiplier.
#[derive(Clone, Debug, PartialEq)]
pub struct Pmt {
    pub id: u32,
    /// Position, metres.
    pub pos: [f64; 3],
    /// Unit vector the photocathode looks along.
    pub dir: [f64; 3],
    /// Calibration time offset, ns (added to the raw hit time).
    pub t0_ns: f64,
}

/// A module: one front-end board with its PMTs.
#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    /// DOM id (KM3NeT) or a running number (ANTARES floor).
    pub id: u32,
    pub string: u32,
    pub floor: u32,
    /// Centre, metres.
    pub pos: [f64; 3],
    pub pmts: Vec<Pmt>,
}

/// The whole detector.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Geometry {
    pub modules: Vec<Module>,
}

/// Why a `.detx` text could not be read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("detx line {line}: {reason}")]
pub struct DetxError {
    pub line: usize,
    pub reason: String,
}

impl Geometry {
    /// The ANTARES-like reference detector with `strings` strings of `floors` floors.
    pub fn antares(strings: u32, floors: u32) -> Geometry {
        let per_row = (f64::from(strings.max(1))).sqrt().ceil() as u32;
        let mut modules = Vec::new();
        for s in 0..strings {
            // A square grid with 70 m spacing, centred on the origin.
            let (gx, gy) = (f64::from(s % per_row), f64::from(s / per_row));
            let half = f64::from(per_row - 1) / 2.0;
            let (x, y) = ((gx - half) * 70.0, (gy - half) * 70.0);
            for f in 0..floors {
                let z = 100.0 + 14.5 * f64::from(f);
                let id = s * floors + f;
                let pmts = (0..3)
                    .map(|k| {
                        // Three OMs 120 degrees apart, 1 m from the floor centre, looking
                        // 45 degrees downwards and outwards.
                        let phi = f64::from(k) * 2.0 * std::f64::consts::PI / 3.0;
                        let (c, sn) = (phi.cos(), phi.sin());
                        let h = std::f64::consts::FRAC_1_SQRT_2;
                        Pmt { id: id * 3 + k, pos: [x + c, y + sn, z], dir: [h * c, h * sn, -h], t0_ns: 0.0 }
                    })
                    .collect();
                modules.push(Module { id, string: s, floor: f, pos: [x, y, z], pmts });
            }
        }
        Geometry { modules }
    }

    /// A KM3NeT/ARCA-like detector: `lines` detection units on a 90 m grid, `doms` DOMs
    /// per line 36 m apart, 31 PMTs per DOM spread over the sphere (ARCA run 267: 453 DOMs).
    pub fn arca_like(lines: u32, doms: u32) -> Geometry {
        let per_row = f64::from(lines.max(1)).sqrt().ceil() as u32;
        let half = f64::from(per_row - 1) / 2.0;
        // 31 directions: a Fibonacci sphere (roughly the DOM's 6 rings + 1 down).
        let dirs: Vec<[f64; 3]> = (0..31)
            .map(|k| {
                let z = 1.0 - 2.0 * (f64::from(k) + 0.5) / 31.0;
                let r = (1.0 - z * z).sqrt();
                let phi = f64::from(k) * std::f64::consts::PI * (3.0 - 5f64.sqrt());
                [r * phi.cos(), r * phi.sin(), -z]
            })
            .collect();
        let mut modules = Vec::new();
        for l in 0..lines {
            let (x, y) = ((f64::from(l % per_row) - half) * 90.0, (f64::from(l / per_row) - half) * 90.0);
            for d in 0..doms {
                let id = 800_000_000 + l * 100 + d;
                let pos = [x, y, 80.0 + 36.0 * f64::from(d)];
                let pmts = dirs
                    .iter()
                    .enumerate()
                    .map(|(k, dir)| Pmt {
                        id: (l * 100 + d) * 31 + k as u32 + 1,
                        pos: [pos[0] + 0.2 * dir[0], pos[1] + 0.2 * dir[1], pos[2] + 0.2 * dir[2]],
                        dir: *dir,
                        t0_ns: 0.0,
                    })
                    .collect();
                modules.push(Module { id, string: l, floor: d + 1, pos, pmts });
            }
        }
        Geometry { modules }
    }

    /// The ANTARES-like detector with at least `modules` floors (30 per string, so 5 gives
    /// one sector of string 0 and 300 gives 10 strings), cut to exactly `modules`.
    pub fn antares_for_sources(modules: u32) -> Geometry {
        let strings = modules.div_ceil(30).max(1);
        let mut g = Geometry::antares(strings, 30);
        g.modules.truncate(modules as usize);
        g
    }

    pub fn pmt_count(&self) -> usize {
        self.modules.iter().map(|m| m.pmts.len()).sum()
    }

    /// Module index of each module id.
    pub fn index_by_id(&self) -> HashMap<u32, usize> {
        self.modules.iter().enumerate().map(|(i, m)| (m.id, i)).collect()
    }

    /// Centre and radius (metres) of the smallest axis-aligned box around all PMTs.
    pub fn bounding_sphere(&self) -> ([f64; 3], f64) {
        let mut lo = [f64::INFINITY; 3];
        let mut hi = [f64::NEG_INFINITY; 3];
        for p in self.modules.iter().flat_map(|m| &m.pmts) {
            for k in 0..3 {
                lo[k] = lo[k].min(p.pos[k]);
                hi[k] = hi[k].max(p.pos[k]);
            }
        }
        if !lo[0].is_finite() {
            return ([0.0; 3], 0.0);
        }
        let c = [(lo[0] + hi[0]) / 2.0, (lo[1] + hi[1]) / 2.0, (lo[2] + hi[2]) / 2.0];
        let r = ((hi[0] - c[0]).powi(2) + (hi[1] - c[1]).powi(2) + (hi[2] - c[2]).powi(2)).sqrt();
        (c, r)
    }

    /// The geometry as a `.detx` text (v1: detector id and module count, then per module
    /// its id, string, floor and PMT count, each PMT's id, position, direction and t0),
    /// which [`Geometry::from_detx`] and KM3NeT's tools read.
    pub fn to_detx(&self, det_id: i32) -> String {
        use std::fmt::Write;
        let mut s = format!("{det_id} {}\n", self.modules.len());
        for m in &self.modules {
            let _ = writeln!(s, "{} {} {} {}", m.id, m.string, m.floor, m.pmts.len());
            for p in &m.pmts {
                let _ = writeln!(
                    s,
                    " {} {:.6} {:.6} {:.6} {:.6} {:.6} {:.6} {:.3}",
                    p.id, p.pos[0], p.pos[1], p.pos[2], p.dir[0], p.dir[1], p.dir[2], p.t0_ns
                );
            }
        }
        s
    }

    /// Reads a KM3NeT `.detx` text (v1 to v5).
    pub fn from_detx(text: &str) -> Result<Geometry, DetxError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.split('#').next().unwrap_or("").trim()))
            .filter(|(_, l)| !l.is_empty());
        let err = |line: usize, reason: &str| DetxError { line, reason: reason.to_string() };
        let (n, first) = lines.next().ok_or_else(|| err(0, "empty file"))?;
        let head: Vec<&str> = first.split_whitespace().collect();
        let version = match head.get(1) {
            Some(v) if v.starts_with(['v', 'V']) => v[1..].parse::<u32>().map_err(|_| err(n, "bad version"))?,
            _ => 1,
        };
        let n_modules: usize = if version >= 2 {
            lines.next(); // validity
            lines.next(); // UTM reference
            let (n, l) = lines.next().ok_or_else(|| err(n, "missing module count"))?;
            l.parse().map_err(|_| err(n, "bad module count"))?
        } else {
            head.get(1).and_then(|s| s.parse().ok()).ok_or_else(|| err(n, "bad module count"))?
        };
        let num = |line: usize, s: Option<&&str>| -> Result<f64, DetxError> {
            s.and_then(|s| s.parse::<f64>().ok()).ok_or_else(|| err(line, "expected a number"))
        };
        let mut modules = Vec::with_capacity(n_modules);
        for _ in 0..n_modules {
            let (ln, l) = lines.next().ok_or_else(|| err(0, "fewer modules than announced"))?;
            let f: Vec<&str> = l.split_whitespace().collect();
            let id = num(ln, f.first())? as u32;
            let string = num(ln, f.get(1))? as u32;
            let floor = num(ln, f.get(2))? as u32;
            let n_pmts = num(ln, f.last())? as usize;
            let (mut pos, has_pos) = if version >= 4 && f.len() >= 7 {
                ([num(ln, f.get(3))?, num(ln, f.get(4))?, num(ln, f.get(5))?], true)
            } else {
                ([0.0; 3], false)
            };
            let mut pmts = Vec::with_capacity(n_pmts);
            for _ in 0..n_pmts {
                let (pl, p) = lines.next().ok_or_else(|| err(ln, "fewer PMTs than announced"))?;
                let g: Vec<&str> = p.split_whitespace().collect();
                if g.len() < 8 {
                    return Err(err(pl, "a PMT line needs id x y z dx dy dz t0"));
                }
                let v = |k: usize| num(pl, g.get(k));
                pmts.push(Pmt {
                    id: v(0)? as u32,
                    pos: [v(1)?, v(2)?, v(3)?],
                    dir: [v(4)?, v(5)?, v(6)?],
                    t0_ns: v(7)?,
                });
            }
            if !has_pos && !pmts.is_empty() {
                let k = pmts.len() as f64;
                for (d, c) in pos.iter_mut().enumerate() {
                    *c = pmts.iter().map(|p| p.pos[d]).sum::<f64>() / k;
                }
            }
            modules.push(Module { id, string, floor, pos, pmts });
        }
        Ok(Geometry { modules })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn antares_reference_shape() {
        let g = Geometry::antares(10, 30);
        assert_eq!(g.modules.len(), 300);
        assert_eq!(g.pmt_count(), 900);
        let m = &g.modules[31];
        assert_eq!((m.string, m.floor), (1, 1));
        assert!((g.modules[1].pos[2] - g.modules[0].pos[2] - 14.5).abs() < 1e-9);
        let d = |a: &Module, b: &Module| ((a.pos[0] - b.pos[0]).powi(2) + (a.pos[1] - b.pos[1]).powi(2)).sqrt();
        assert!((d(&g.modules[0], &g.modules[30]) - 70.0).abs() < 1e-9);
        for p in g.modules.iter().flat_map(|m| &m.pmts) {
            let n = (p.dir[0].powi(2) + p.dir[1].powi(2) + p.dir[2].powi(2)).sqrt();
            assert!((n - 1.0).abs() < 1e-9 && p.dir[2] < 0.0);
        }
        assert_eq!(Geometry::antares_for_sources(5).modules.len(), 5);
    }

    #[test]
    fn a_written_detx_reads_back() {
        let g = Geometry::arca_like(2, 3);
        let back = Geometry::from_detx(&g.to_detx(133)).unwrap();
        assert_eq!(back.modules.len(), 6);
        for (a, b) in g.modules.iter().zip(&back.modules) {
            assert_eq!((a.id, a.string, a.floor, a.pmts.len()), (b.id, b.string, b.floor, b.pmts.len()));
            for k in 0..3 {
                assert!((a.pos[k] - b.pos[k]).abs() < 1e-3 && (a.pmts[7].dir[k] - b.pmts[7].dir[k]).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn reads_detx_v1_and_v5() {
        let v1 = "1 2\n1 1 1 2\n 1 1.0 2.0 3.0 0 0 -1 10.0\n 2 1.0 2.0 5.0 0 0 1 20.0\n2 1 2 1\n 3 0 0 0 1 0 0 30\n";
        let g = Geometry::from_detx(v1).unwrap();
        assert_eq!(g.modules.len(), 2);
        assert_eq!(g.modules[0].pos, [1.0, 2.0, 4.0]);
        assert_eq!(g.modules[0].pmts[1].t0_ns, 20.0);
        let v5 = "# c\n133 V5\n 1.0 2.0\nUTM WGS84 33N +5 +4 -3\n1\n 817597102 5 1 -165.18 +91.84 +64.885 1 0 0 0 0.0 0 2\n 28208 -165.180 +91.674 +64.996 +0.000065 -0.831879 +0.554957 +479697.140 0\n 23872 -165.371 +91.840 +64.944 -0.955473 -0.000031 +0.295087 +479695.993 0\n";
        let g = Geometry::from_detx(v5).unwrap();
        assert_eq!(g.modules[0].id, 817597102);
        assert_eq!((g.modules[0].string, g.modules[0].floor), (5, 1));
        assert_eq!(g.modules[0].pos, [-165.18, 91.84, 64.885]);
        assert_eq!(g.modules[0].pmts[1].t0_ns, 479695.993);
        assert!(Geometry::from_detx("133 V5\n1 2\nUTM\n3\n1 1 1 0 0 0 1 0 0 0 0 0 1\n").is_err());
        assert!(Geometry::from_detx("").is_err());
    }
}
