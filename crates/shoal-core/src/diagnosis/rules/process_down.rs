//! A process is gone: it exited, left the dispatcher, or never announced itself. Its
//! part of the run is lost until run control restarts it.

use super::super::{Evaluation, Finding, Presence, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in &ev.snapshot.processes {
        if let Presence::Down(why) = &p.presence {
            out.push(super::finding(Rule::ProcessDown, p, format!("down: {why}")));
        }
    }
}
