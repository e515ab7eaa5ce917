//! The data processes' clocks differ so much that fragments miss their slices or the
//! builders' timeouts (the verdict of [`crate::clocksync::judge`] after run control's
//! latest round is `beyond`, and beyond even at the near ends of the measurements'
//! uncertainty): named on the two processes furthest apart. The verdict's level is judged at
//! the near ends of the clocks' bounds, so one slow round trip (a busy host at a run's
//! start) cannot put it beyond on its own; a skew only over what the policy absorbs
//! (`degraded`: slices wait a little longer) loses nothing. Prometheus's `ShoalClockSkew` watches the
//! verdict itself.

use super::super::{Evaluation, Finding, Rule};
use crate::clocksync::ClockLevel;

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    let Some(v) = &ev.snapshot.clock else { return };
    if v.level < ClockLevel::Beyond || v.skew_certain_ns <= v.limit_ns {
        return;
    }
    let Some((ahead, behind)) = &v.between else { return };
    for name in [ahead, behind] {
        if let Some(p) = ev.snapshot.processes.iter().find(|p| &p.name == name) {
            out.push(super::finding(Rule::ClockSkew, p, v.reason.clone()));
        }
    }
}
