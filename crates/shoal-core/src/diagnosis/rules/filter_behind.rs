//! A builder's filter falls behind: slices were assembled but its queue to the filter was
//! full, so they went unfiltered (their fragments delivered, their events lost); or the
//! filter was busy nearly all the time since the last look (its queue, and then the
//! builder's memory, fill: the builder's discards that follow are its symptom).

use super::super::{Evaluation, Finding, Rule};

/// Share of the time busy from which a filter is behind (a filter at 95 % keeps up only
/// without any burst).
pub const BUSY_SHARE: f64 = 0.95;

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "builder") {
        let g = ev.growth_of(&p.name);
        // Over the time between the two statistics seen (the process's own clock).
        let busy = if g.taken_ns > 0 { g.filter_busy_ns as f64 / g.taken_ns as f64 } else { 0.0 };
        if g.slices_not_filtered > 0 {
            out.push(super::finding(
                Rule::FilterBehind,
                p,
                format!("{} slices not filtered (the filter's queue was full)", g.slices_not_filtered),
            ));
        } else if busy >= BUSY_SHARE {
            out.push(super::finding(
                Rule::FilterBehind,
                p,
                format!("the filter was busy {:.0} % of the time", (busy * 100.0).min(100.0)),
            ));
        }
    }
}
