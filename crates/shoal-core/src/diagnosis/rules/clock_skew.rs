//! The data processes' clocks differ by more than the policy absorbs (the verdict of
//! [`crate::clocksync::judge`] after run control's latest round): named on the two
//! processes furthest apart.

use super::super::{Evaluation, Finding, Rule};
use crate::clocksync::ClockLevel;

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    let Some(v) = &ev.snapshot.clock else { return };
    if v.level == ClockLevel::Ok {
        return;
    }
    let Some((ahead, behind)) = &v.between else { return };
    for name in [ahead, behind] {
        if let Some(p) = ev.snapshot.processes.iter().find(|p| &p.name == name) {
            out.push(super::finding(Rule::ClockSkew, p, v.reason.clone()));
        }
    }
}
