//! Minimal SVG charts (no font or system dependency): lines over x, optionally log-scale y,
//! and bar charts. Enough for delay-versus-slice plots and sweep comparisons.

use std::fmt::Write;

const W: f64 = 900.0;
const L: f64 = 80.0;
const R: f64 = 190.0;
const T: f64 = 40.0;

/// Canvas height and bottom margin: line charts need one row of tick labels, bar charts room
/// for rotated labels.
#[derive(Clone, Copy)]
struct Rows {
    h: f64,
    b: f64,
}

const LINES: Rows = Rows { h: 420.0, b: 60.0 };
const BARS: Rows = Rows { h: 620.0, b: 260.0 };
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Axis {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = (if log { 1.0 } else { 0.0 }, 1.0);
        }
        if log {
            lo = 10f64.powf(lo.log10().floor());
            hi = 10f64.powf(hi.log10().ceil().max(lo.log10() + 1.0));
        } else {
            lo = lo.min(0.0);
            if hi <= lo {
                hi = lo + 1.0;
            }
        }
        Axis { lo, hi, log }
    }
    fn frac(&self, v: f64) -> f64 {
        if self.log {
            (v.max(self.lo).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut t = Vec::new();
            let mut v = self.lo;
            while v <= self.hi * 1.0001 {
                t.push(v);
                v *= 10.0;
            }
            t
        } else {
            (0..=5).map(|i| self.lo + (self.hi - self.lo) * f64::from(i) / 5.0).collect()
        }
    }
}

fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.abs() < 0.01 {
        format!("{v:.0e}")
    } else {
        format!("{}", (v * 100.0).round() / 100.0)
    }
}

#[allow(non_snake_case)] // H and B keep the names of the layout constants they vary
fn frame(title: &str, xl: &str, yl: &str, y: &Axis, rows: Rows) -> String {
    let Rows { h: H, b: B } = rows;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        (W - R + L) / 2.0,
        esc(title)
    );
    let _ = write!(
        s,
        r#"<line x1="{L}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{L}" y1="{T}" x2="{L}" y2="{}" stroke="black"/>"#,
        H - B,
        W - R,
        H - B,
        H - B
    );
    for t in y.ticks() {
        let py = H - B - y.frac(t) * (H - T - B);
        let _ = write!(
            s,
            r##"<line x1="{L}" y1="{py}" x2="{}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            W - R,
            L - 6.0,
            py + 4.0,
            fmt_num(t)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (W - R + L) / 2.0,
        H - 18.0,
        esc(xl),
        (H - B + T) / 2.0,
        esc(yl)
    );
    s
}

/// Line chart of several series of (x, y) points.
#[allow(non_snake_case)] // H and B keep the names of the layout constants they vary
pub fn lines(title: &str, xl: &str, yl: &str, series: &[(String, Vec<(f64, f64)>)], log_y: bool) -> String {
    let Rows { h: H, b: B } = LINES;
    let x = Axis::new(series.iter().flat_map(|s| s.1.iter().map(|p| p.0)), false);
    let y = Axis::new(series.iter().flat_map(|s| s.1.iter().map(|p| p.1)), log_y);
    let mut s = frame(title, xl, yl, &y, LINES);
    for t in x.ticks() {
        let px = L + x.frac(t) * (W - L - R);
        let _ = write!(s, r#"<text x="{px}" y="{}" text-anchor="middle">{}</text>"#, H - B + 16.0, fmt_num(t));
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut d = String::new();
        for (j, &(px, py)) in pts.iter().filter(|p| !log_y || p.1 > 0.0).enumerate() {
            let sx = L + x.frac(px) * (W - L - R);
            let sy = H - B - y.frac(py) * (H - T - B);
            let _ = write!(d, "{}{sx:.1},{sy:.1} ", if j == 0 { "M" } else { "L" });
        }
        let _ = write!(s, r#"<path d="{d}" fill="none" stroke="{c}" stroke-width="1.2"/>"#);
        let ly = T + 16.0 * i as f64;
        let _ = write!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            W - R + 10.0,
            W - R + 30.0,
            W - R + 35.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Bar chart: one bar per label.
#[allow(non_snake_case)] // H and B keep the names of the layout constants they vary
pub fn bars(title: &str, yl: &str, items: &[(String, f64)], log_y: bool) -> String {
    let Rows { h: H, b: B } = BARS;
    let y = Axis::new(items.iter().map(|i| i.1), log_y);
    let mut s = frame(title, "", yl, &y, BARS);
    let n = items.len().max(1) as f64;
    let bw = (W - L - R) / n;
    for (i, (label, v)) in items.iter().enumerate() {
        let x0 = L + bw * i as f64 + bw * 0.15;
        let top = H - B - y.frac(*v) * (H - T - B);
        let _ = write!(
            s,
            r#"<rect x="{x0:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"/><text transform="translate({:.1},{}) rotate(65)" font-size="10">{}</text>"#,
            bw * 0.7,
            (H - B - top).max(0.0),
            COLORS[0],
            x0 + bw * 0.35,
            H - B + 10.0,
            esc(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_svg() {
        let s = lines("t <&>", "x", "y", &[("a".into(), vec![(0.0, 1.0), (1.0, 100.0)])], true);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n") && s.contains("&lt;&amp;&gt;"));
        let b = bars("b", "y", &[("x".into(), 3.0), ("y".into(), 0.0)], false);
        assert_eq!(b.matches("<rect").count(), 3, "background + 2 bars");
    }
}
