//! A builder discards fragments it received: no memory left in its budget for them
//! (overload), or they came after their slice was processed (late).

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "builder") {
        let n = ev.growth_of(&p.name).fragments_discarded_at_builder;
        if n > 0 {
            out.push(super::finding(
                Rule::BuilderDiscarding,
                p,
                format!("discarded {n} fragments (overload or late) since the last look"),
            ));
        }
    }
}
