//! A builder discards fragments it received: no memory left in its budget for them
//! (overload: the budget refusing), or they came after their slice was processed (late),
//! or twice.

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "builder") {
        let g = ev.growth_of(&p.name);
        let n = g.fragments_discarded_at_builder;
        if n > 0 {
            let budget = g.fragments_refused_by_budget.min(n);
            out.push(super::finding(
                Rule::BuilderDiscarding,
                p,
                format!(
                    "discarded {n} fragments since the last look: {budget} refused by its memory budget, {} late or twice",
                    n - budget
                ),
            ));
        }
    }
}
