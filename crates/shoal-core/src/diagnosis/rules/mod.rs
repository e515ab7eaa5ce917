//! The rules, one module each. A rule is a function over an [`Evaluation`] that adds one
//! [`Finding`] per process it finds the problem on; rules do not know of each other (the
//! priority between them is [`Rule`]'s order, used when slices are attributed).

pub mod builder_discarding;
pub mod clock_skew;
pub mod config_mismatch;
pub mod connections_refused;
pub mod filter_behind;
pub mod network_path;
pub mod process_down;
pub mod process_hung;
pub mod source_cut_off;
pub mod source_dropping;
pub mod storage_failing;

use super::{Evaluation, Finding, ProcessView, Rule};

/// Every rule, in [`Rule`]'s order.
pub fn check_all(ev: &Evaluation) -> Vec<Finding> {
    let mut out = Vec::new();
    for rule in Rule::ALL {
        match rule {
            Rule::ProcessDown => process_down::check(ev, &mut out),
            Rule::ProcessHung => process_hung::check(ev, &mut out),
            Rule::BuilderDiscarding => builder_discarding::check(ev, &mut out),
            Rule::FilterBehind => filter_behind::check(ev, &mut out),
            Rule::SourceDropping => source_dropping::check(ev, &mut out),
            Rule::ConnectionsRefused => connections_refused::check(ev, &mut out),
            Rule::ClockSkew => clock_skew::check(ev, &mut out),
            Rule::ConfigMismatch => config_mismatch::check(ev, &mut out),
            Rule::StorageFailing => storage_failing::check(ev, &mut out),
            Rule::NetworkPath => network_path::check(ev, &mut out),
            Rule::SourceCutOff => source_cut_off::check(ev, &mut out),
        }
    }
    out
}

fn finding(rule: Rule, p: &ProcessView, detail: String) -> Finding {
    Finding { rule, process: p.name.clone(), role: p.role.clone(), detail }
}
