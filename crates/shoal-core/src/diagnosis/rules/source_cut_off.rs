//! A source cut fragments off: a burst went over its rate limit and the burst cutoff
//! replaced the fragments of the burst's middle by empty markers. The slices stay
//! complete (the markers arrive), so no slice is lost, but their data is: said here.

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    if !ev.snapshot.running {
        return;
    }
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "source") {
        let g = ev.growth_of(&p.name);
        if g.fragments_cut_off > 0 {
            out.push(super::finding(
                Rule::SourceCutOff,
                p,
                format!(
                    "cut off {} of {} fragments since the last look (a burst)",
                    g.fragments_cut_off, g.fragments_produced
                ),
            ));
        }
    }
}
