//! What KM3NeT's DataFilter publishes besides its events, sans-IO: from the DOM frames of
//! one complete timeslice, the L1 and supernova timeslices (frames holding only the hits
//! in local coincidence) and the summaryslice (per-PMT rates); and the JDAQEvent of a
//! selected event. The builder (shoal-net's `km3out`) calls these and publishes the
//! results on `IO_TSL0`/`IO_TSL1`/`IO_TSSN`/`IO_EVT`/`IO_SUM`.
//!
//! Definitions (docs/km3net.md):
//! - **L1 hit**: a hit with a hit on another PMT of the same DOM within `l1_window_ns`
//!   (KM3NeT's local coincidence, `TMaxLocal`).
//! - **L2 hit**: an L1 hit whose partner PMT looks within `l2_ct_min` (cosine of the angle)
//!   of its own direction (KM3NeT's L2; needs the detector file's PMT directions).
//! - **SN hit**: a hit of a coincidence of at least `sn_min_pmts` distinct PMTs of one DOM
//!   within `sn_window_ns` (the supernova trigger's input: high-multiplicity coincidences).
//! - **Rate** of a PMT: its hits in the frame divided by the timeslice length, in the
//!   summary frame's one-byte logarithmic code.

use super::clb::ClbHit;
use super::jdaq::{DOM_PMTS, JdaqFrame, JdaqSummaryFrame, rate_code};

/// The DataFilter's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataFilterParams {
    pub l1_window_ns: u32,
    pub sn_window_ns: u32,
    pub sn_min_pmts: usize,
}

impl Default for DataFilterParams {
    fn default() -> Self {
        Self { l1_window_ns: 10, sn_window_ns: 10, sn_min_pmts: 4 }
    }
}

/// The hits of `hits` (any order) that have at least `min_pmts` distinct PMTs, their own
/// included, within `window_ns` around them; in their order in `hits` (a frame keeps the
/// DataQueue's order).
pub fn coincident_hits(hits: &[ClbHit], window_ns: u32, min_pmts: usize) -> Vec<ClbHit> {
    let mut order: Vec<usize> = (0..hits.len()).collect();
    order.sort_unstable_by_key(|&i| (hits[i].time_ns, i));
    let time = |k: usize| hits[order[k]].time_ns;
    let mut keep = vec![false; hits.len()];
    let (mut lo, mut hi) = (0, 0);
    for k in 0..order.len() {
        let t = time(k);
        while time(lo).saturating_add(window_ns) < t {
            lo += 1;
        }
        hi = hi.max(k);
        while hi + 1 < order.len() && time(hi + 1) <= t.saturating_add(window_ns) {
            hi += 1;
        }
        // Distinct PMTs in [lo, hi]: at most 256 channels, counted with a bit set.
        let mut seen = [0u64; 4];
        let mut n = 0;
        for &i in &order[lo..=hi] {
            let c = hits[i].channel;
            let (w, b) = (usize::from(c / 64), c % 64);
            if seen[w] & (1 << b) == 0 {
                seen[w] |= 1 << b;
                n += 1;
            }
        }
        keep[order[k]] = n >= min_pmts;
    }
    hits.iter().zip(keep).filter(|&(_, k)| k).map(|(h, _)| *h).collect()
}

/// The hits of `hits` (any order) with a hit on another PMT within `window_ns` whose
/// direction is within the angle of `ct_min` (cosine) of its own: KM3NeT's L2 (`dirs[c]`
/// is PMT `c`'s unit direction; a channel without one never makes an L2). In their order
/// in `hits`.
pub fn l2_hits(hits: &[ClbHit], window_ns: u32, dirs: &[[f64; 3]], ct_min: f64) -> Vec<ClbHit> {
    let mut order: Vec<usize> = (0..hits.len()).collect();
    order.sort_unstable_by_key(|&i| (hits[i].time_ns, i));
    let dir = |c: u8| dirs.get(usize::from(c));
    let mut keep = vec![false; hits.len()];
    let mut lo = 0;
    for k in 0..order.len() {
        let hk = hits[order[k]];
        while hits[order[lo]].time_ns.saturating_add(window_ns) < hk.time_ns {
            lo += 1;
        }
        let Some(dk) = dir(hk.channel) else { continue };
        for &o in order[lo..].iter().take_while(|&&o| hits[o].time_ns <= hk.time_ns.saturating_add(window_ns)) {
            let h = hits[o];
            if h.channel == hk.channel {
                continue;
            }
            if let Some(d) = dir(h.channel)
                && dk[0] * d[0] + dk[1] * d[1] + dk[2] * d[2] >= ct_min
            {
                keep[order[k]] = true;
                break;
            }
        }
    }
    hits.iter().zip(keep).filter(|&(_, k)| k).map(|(h, _)| *h).collect()
}

/// A frame with only its L2 hits (see [`l2_hits`]), statuses kept.
pub fn l2_frame(f: &JdaqFrame, window_ns: u32, dirs: &[[f64; 3]], ct_min: f64) -> JdaqFrame {
    JdaqFrame {
        dom_id: f.dom_id,
        dataqueue_status: f.dataqueue_status,
        dom_status: f.dom_status,
        hits: l2_hits(&f.hits, window_ns, dirs, ct_min),
    }
}

/// A frame with only its L1 hits (`sn == false`) or SN hits, statuses kept.
pub fn filtered_frame(f: &JdaqFrame, p: &DataFilterParams, sn: bool) -> JdaqFrame {
    let hits = if sn {
        coincident_hits(&f.hits, p.sn_window_ns, p.sn_min_pmts)
    } else {
        coincident_hits(&f.hits, p.l1_window_ns, 2)
    };
    JdaqFrame { dom_id: f.dom_id, dataqueue_status: f.dataqueue_status, dom_status: f.dom_status, hits }
}

/// A frame's summary: every PMT's rate over `slice_ns`.
pub fn summary_frame(f: &JdaqFrame, slice_ns: u64) -> JdaqSummaryFrame {
    let mut counts = [0u64; DOM_PMTS];
    for h in &f.hits {
        if let Some(c) = counts.get_mut(usize::from(h.channel)) {
            *c += 1;
        }
    }
    let seconds = slice_ns as f64 * 1e-9;
    let mut rates = [0u8; DOM_PMTS];
    for (r, c) in rates.iter_mut().zip(counts) {
        *r = rate_code(c as f64 / seconds);
    }
    JdaqSummaryFrame { dom_id: f.dom_id, dataqueue_status: f.dataqueue_status, dom_status: f.dom_status, rates }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::km3net::jdaq::rate_hz;

    fn hit(channel: u8, time_ns: u32) -> ClbHit {
        ClbHit { channel, time_ns, tot: 26 }
    }

    #[test]
    fn l1_needs_another_pmt_within_the_window() {
        let hits = [hit(1, 100), hit(1, 105), hit(2, 300), hit(3, 309), hit(4, 500), hit(5, 520)];
        let l1 = coincident_hits(&hits, 10, 2);
        assert_eq!(l1, [hit(2, 300), hit(3, 309)], "same PMT twice is not a coincidence; 20 ns is too far");
        let unsorted = [hit(3, 309), hit(2, 300), hit(9, 0)];
        assert_eq!(coincident_hits(&unsorted, 10, 2), [hit(3, 309), hit(2, 300)], "the frame's order is kept");
    }

    #[test]
    fn l2_needs_the_partner_pmt_to_look_the_same_way() {
        // PMT 0 looks down, 1 nearly down, 2 up.
        let dirs = [[0.0, 0.0, -1.0], [0.0, 0.6, -0.8], [0.0, 0.0, 1.0]];
        let hits = [hit(0, 100), hit(2, 103), hit(0, 500), hit(1, 505), hit(7, 506)];
        assert_eq!(coincident_hits(&hits, 10, 2).len(), 5, "all are L1");
        assert_eq!(
            l2_hits(&hits, 10, &dirs, 0.0),
            [hit(0, 500), hit(1, 505)],
            "opposite PMTs and a PMT without a direction are not L2"
        );
        assert!(l2_hits(&hits, 10, &dirs, 0.9).is_empty(), "36.9 degrees apart is too much for cos 0.9");
    }

    #[test]
    fn sn_needs_the_multiplicity() {
        let hits = [hit(1, 0), hit(2, 3), hit(3, 5), hit(4, 8), hit(1, 1000), hit(2, 1004), hit(3, 1006)];
        let sn = coincident_hits(&hits, 10, 4);
        assert_eq!(sn.len(), 4, "{sn:?}");
        assert!(sn.iter().all(|h| h.time_ns < 10));
    }

    #[test]
    fn summary_rates_within_the_encoding_precision() {
        // 700 hits on PMT 3 in 100 ms: 7 kHz.
        let f = JdaqFrame {
            dom_id: 7,
            dataqueue_status: 3,
            dom_status: [1, 2, 3, 4],
            hits: (0..700).map(|i| hit(3, i * 100)).collect(),
        };
        let s = summary_frame(&f, 100_000_000);
        let got = rate_hz(s.rates[3]);
        assert!((got / 7_000.0 - 1.0).abs() < 0.014, "{got}");
        assert_eq!(s.rates.iter().filter(|&&r| r != 0).count(), 1);
        assert_eq!((s.dom_id, s.dataqueue_status, s.dom_status), (7, 3, [1, 2, 3, 4]));
    }
}
