//! A process closes connections it cannot trust: bad magic or CRC, another frame
//! version, a source it does not expect (a configuration mismatch between processes, or
//! a stranger on its port).

use super::super::{Evaluation, Finding, Rule};

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    for p in &ev.snapshot.processes {
        let n = ev.growth_of(&p.name).rejected_connections;
        if n > 0 {
            out.push(super::finding(
                Rule::ConnectionsRefused,
                p,
                format!("refused {n} connections since the last look"),
            ));
        }
    }
}
