//! The writer's disk fails the data: it refused a write (full, gone, read-only; what
//! arrives since is not stored), or it was busy writing nearly all the time since the last
//! look (slower than the data: its queue, then the builders' links to the writer fill).

use super::super::{Evaluation, Finding, Rule};

/// Share of the time writing from which a disk is too slow.
pub const BUSY_SHARE: f64 = 0.9;

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "writer") {
        let g = ev.growth_of(&p.name);
        if p.counters.storage_failed > 0 {
            out.push(super::finding(
                Rule::StorageFailing,
                p,
                "its disk refused a write: the events arriving since are not stored".into(),
            ));
            continue;
        }
        let busy = if g.taken_ns > 0 { g.storage_busy_ns as f64 / g.taken_ns as f64 } else { 0.0 };
        if busy >= BUSY_SHARE {
            out.push(super::finding(
                Rule::StorageFailing,
                p,
                format!(
                    "its disk was busy writing {:.0} % of the time: slower than the data",
                    (busy * 100.0).min(100.0)
                ),
            ));
        }
    }
}
