//! A source drops fragments: its queue is full (it is behind: back-pressure from a builder
//! or the network), a burst went over its limit, or a connection failed under it.

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    if !ev.snapshot.running {
        return;
    }
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "source") {
        let g = ev.growth_of(&p.name);
        if g.fragments_dropped_at_source > 0 {
            out.push(super::finding(
                Rule::SourceDropping,
                p,
                format!(
                    "dropped {} of {} fragments since the last look",
                    g.fragments_dropped_at_source, g.fragments_produced
                ),
            ));
        }
    }
}
