//! A builder's filter falls behind: slices were assembled but its queue to the filter was
//! full, so they went unfiltered (their fragments delivered, their events lost).

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "builder") {
        let n = ev.growth_of(&p.name).slices_not_filtered;
        if n > 0 {
            out.push(super::finding(
                Rule::FilterBehind,
                p,
                format!("builder {}: {n} slices not filtered (the filter's queue was full)", p.name),
            ));
        }
    }
}
