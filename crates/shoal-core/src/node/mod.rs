//! Node machines: everything a source process and a builder process decide, as sans-IO
//! state machines that the runtime (tokio, real sockets), the simulator (modelled network)
//! and `shoal replay` drive alike.
//!
//! - [`SourceNode`] hosts one or more sources (boards): the slice schedule (first slice,
//!   slice ends reached late, end slice, pause), each source's burst cutoff and shaper, the
//!   pending fragments, the stall limit, the per-builder queue limit and drop-at-source, the
//!   end-of-run drain with its slot ticks and deadline, the end-of-stream markers and the
//!   tallies. The driver moves bytes ([`SourceTransmit`]) and reports what the transport did
//!   with them ([`SourceNode::handle_sent`], [`SourceNode::handle_send_failed`]).
//! - [`BuilderNode`] wraps the [`crate::assembly::SliceAssembler`] with what a builder adds:
//!   which sources have ended their stream, the hand-off of processed slices to the filter
//!   and the release of their memory, per-slice outcome counts and the report.
//! - [`DataFlowManager`] (credit-based pull): assigns each slice to a builder with a free
//!   credit; [`PullRequester`] is a pull builder's side (requests, re-asks, give-ups), the
//!   sources' side is the [`crate::shaping::Pull`] shaper inside the source node.
//! - [`Workload`]: where a source's data come from (fixed-size fragments, the burst model,
//!   the noise and physics generators, replay), implemented in shoal-detector.
//!
//! Shape (quinn-proto): inputs are `handle_*(now, ...)`, outputs are drained with `poll_*`,
//! and `poll_timeout` says when to call `handle_timeout` next. Inputs that later policies
//! need (datagram loss reports, alerts) come in the same way.

mod builder;
mod dfm;
mod pull;
mod slice_map;
mod source;
mod workload;

pub use builder::{
    Arrival, ArrivalOutcome, BuilderNode, BuilderNodeConfig, BuilderNodeReport, IncompleteSlice, MAX_LISTED_SLICES,
};
pub use dfm::{Assignment, DataFlowManager, DfmConfig, DfmEvent, DfmStats};
pub use pull::{ASSIGNED_HISTORY, FragmentRequest, PullRequester, PullStats};
pub use source::{
    CutoffConfig, SourceEvent, SourceNode, SourceNodeConfig, SourceNodeReport, SourceTotals, SourceTransmit,
    TransmitKind, TransmitRecord,
};
pub use workload::{GeneratedFragment, Workload};

use crate::Duration;
use crate::slice::{SliceClock, SliceNumber};

/// How long after the first slice of a run delays count as steady state: the first
/// second has new connections, cold processes and first wake-ups in it, which a
/// comparison of networks (simulator against testbed) leaves out on both sides.
pub const STEADY_AFTER: Duration = Duration::from_secs(1);

/// The first slice whose delays count as steady state, for a run that starts at `first`.
pub fn steady_from(first: SliceNumber, clock: SliceClock) -> SliceNumber {
    let len = clock.length().as_nanos().max(1);
    first + STEADY_AFTER.as_nanos().div_ceil(len) as u64
}

#[cfg(test)]
mod steady_tests {
    #[test]
    fn steady_state_starts_a_second_of_slices_later() {
        let ms = |n| crate::slice::SliceClock::new(crate::Duration::from_millis(n));
        assert_eq!(super::steady_from(500, ms(10)), 600);
        assert_eq!(super::steady_from(0, ms(300)), 4);
        assert_eq!(super::steady_from(7, ms(1000)), 8);
    }
}
