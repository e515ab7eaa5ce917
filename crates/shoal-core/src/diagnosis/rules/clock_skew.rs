//! The data processes' clocks differ so much that fragments miss their slices or the
//! builders' timeouts (the verdict of [`crate::clocksync::judge`] after run control's
//! latest round is `beyond`): named on the two processes furthest apart. A skew only over
//! what the policy absorbs (`degraded`: slices wait a little longer) loses nothing and is
//! not a problem here; it is measured at the far ends of the measurements' uncertainty, so
//! a busy host's round trips alone can put it there (Prometheus's `ShoalClockSkew` watches
//! that level).

use super::super::{Evaluation, Finding, Rule};
use crate::clocksync::ClockLevel;

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    let Some(v) = &ev.snapshot.clock else { return };
    if v.level < ClockLevel::Beyond {
        return;
    }
    let Some((ahead, behind)) = &v.between else { return };
    for name in [ahead, behind] {
        if let Some(p) = ev.snapshot.processes.iter().find(|p| &p.name == name) {
            out.push(super::finding(Rule::ClockSkew, p, v.reason.clone()));
        }
    }
}
