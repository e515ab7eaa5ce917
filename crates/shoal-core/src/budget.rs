//! One memory budget per process, divided at start among the queues of the roles it hosts.
//!
//! Every queue that holds data in a shoal process has a bound: a builder's assembler and
//! filter queue (`builder.memory_budget_mb`), its burst-saver history (`saver.max_mb`), the
//! writer's and dispatcher's queues, and each source node's backlog
//! ([`crate::node::SourceNodeConfig::held_limit_bytes`]). [`MemoryDemand::plan`] checks that
//! the fixed bounds fit the process's budget, gives the source nodes what is left (equal
//! shares), and refuses a configuration that cannot run: a builder that cannot hold two
//! slices, fixed bounds above the budget, or source shares too small for a few slices of
//! backlog. A refusal says why in numbers; the driver adds what would fit
//! ([`largest_fitting`]).
//!
//! Pure arithmetic: the driver measures the fragment size and the machine's memory.

use std::fmt;

/// Slices a builder's memory must hold at least: the one being filled and the next.
pub const MIN_BUILDER_SLICES: u64 = 2;
/// Slices of backlog a source node's share must hold at least (a board with less buffer
/// than this drops data at the first hiccup of the network).
pub const MIN_SOURCE_SLICES: u64 = 4;

/// What one process asks of memory, from its configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryDemand {
    /// The process's budget, bytes.
    pub budget: u64,
    /// Sources in the run (a builder holds a slice of all of them).
    pub run_sources: u64,
    /// The expected size of one fragment on the wire (header included), bytes.
    pub fragment_bytes: u64,
    /// Sources hosted by each source node of this process (empty: no source role).
    pub source_nodes: Vec<u64>,
    /// Builders connected to by each source node: bounds its transport queue
    /// (`per_builder_queue` each).
    pub run_builders: u64,
    pub per_builder_queue: u64,
    /// Builders hosted by this process.
    pub builders: u64,
    /// Each builder's assembler + filter queue bound.
    pub builder_memory: u64,
    /// Each builder's burst-saver history bound (0: saver off).
    pub saver_memory: u64,
    /// Other bounded queues and the runtime itself (name, bytes).
    pub fixed: Vec<(&'static str, u64)>,
    /// Memory per hosted source besides its backlog (generator, shaper, tallies).
    pub per_source: u64,
}

/// How the budget is divided.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub budget: u64,
    /// Each source node's bound on what it holds, bytes (the same for every node).
    pub source_node_limit: u64,
    /// Every share (name, bytes), summing to at most the budget.
    pub shares: Vec<(String, u64)>,
}

impl MemoryPlan {
    pub fn total(&self) -> u64 {
        self.shares.iter().map(|(_, b)| b).sum()
    }
}

/// Why a configuration cannot run within its budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A builder's memory holds fewer than [`MIN_BUILDER_SLICES`] slices.
    BuilderTooSmall { slice_bytes: u64, builder_memory: u64, needed: u64 },
    /// The fixed bounds alone exceed the budget (or leave sources less than their minimum).
    OverBudget { needed: u64, budget: u64, detail: String },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::BuilderTooSmall { slice_bytes, builder_memory, needed } => write!(
                f,
                "a slice of every source is about {} and a builder's memory (builder.memory_budget_mb) is {}: \
                 it must hold at least {MIN_BUILDER_SLICES} slices ({})",
                mib(*slice_bytes),
                mib(*builder_memory),
                mib(*needed)
            ),
            Refusal::OverBudget { needed, budget, detail } => write!(
                f,
                "this process needs at least {} but its memory budget (run.memory_mb) is {}: {detail}",
                mib(*needed),
                mib(*budget)
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// Bytes as MiB for messages.
pub fn mib(bytes: u64) -> String {
    let m = bytes as f64 / f64::from(1u32 << 20);
    if m >= 100.0 { format!("{m:.0} MiB") } else { format!("{m:.1} MiB") }
}

impl MemoryDemand {
    /// Divides the budget, or says why it cannot be.
    pub fn plan(&self) -> Result<MemoryPlan, Refusal> {
        let slice_bytes = self.run_sources.saturating_mul(self.fragment_bytes);
        if self.builders > 0 {
            let needed = slice_bytes.saturating_mul(MIN_BUILDER_SLICES);
            if self.builder_memory < needed {
                return Err(Refusal::BuilderTooSmall { slice_bytes, builder_memory: self.builder_memory, needed });
            }
        }
        let mut shares: Vec<(String, u64)> = Vec::new();
        if self.builders > 0 {
            shares.push((
                format!("builders {} x {}", self.builders, mib(self.builder_memory)),
                self.builders * self.builder_memory,
            ));
            if self.saver_memory > 0 {
                shares.push((
                    format!("burst savers {} x {}", self.builders, mib(self.saver_memory)),
                    self.builders * self.saver_memory,
                ));
            }
        }
        for (name, bytes) in &self.fixed {
            shares.push((name.to_string(), *bytes));
        }
        let hosted: u64 = self.source_nodes.iter().sum();
        if hosted > 0 {
            shares.push((format!("{hosted} sources' state"), hosted.saturating_mul(self.per_source)));
        }
        let fixed: u64 = shares.iter().map(|(_, b)| b).fold(0u64, |a, b| a.saturating_add(*b));
        let nodes = self.source_nodes.len() as u64;
        let largest_node = self.source_nodes.iter().copied().max().unwrap_or(0);
        let node_min = largest_node.saturating_mul(self.fragment_bytes).saturating_mul(MIN_SOURCE_SLICES);
        let sources_min = node_min.saturating_mul(nodes);
        if fixed.saturating_add(sources_min) > self.budget {
            let detail = shares.iter().map(|(n, b)| format!("{n} = {}", mib(*b))).collect::<Vec<_>>().join(", ");
            let detail = if nodes > 0 {
                format!(
                    "{detail}, and {nodes} source nodes x {MIN_SOURCE_SLICES} slices of backlog ({} each)",
                    mib(node_min)
                )
            } else {
                detail
            };
            return Err(Refusal::OverBudget { needed: fixed.saturating_add(sources_min), budget: self.budget, detail });
        }
        let mut source_node_limit = 0;
        if let Some(share) = (self.budget - fixed).checked_div(nodes) {
            let cap = self.per_builder_queue.saturating_mul(self.run_builders.max(1));
            source_node_limit = share.min(cap).max(node_min);
            shares.push((format!("{nodes} source nodes x {}", mib(source_node_limit)), source_node_limit * nodes));
        }
        Ok(MemoryPlan { budget: self.budget, source_node_limit, shares })
    }
}

/// The largest `n` in `1..=upper` for which `fits(n)` holds, assuming it holds for every
/// smaller `n` once it holds for one (more sources never need less memory); `None` if not
/// even 1 fits.
pub fn largest_fitting(upper: u64, fits: impl Fn(u64) -> bool) -> Option<u64> {
    if upper == 0 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1, upper);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) { lo = mid } else { hi = mid - 1 }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn demo(sources: u64, per_node: u64) -> MemoryDemand {
        MemoryDemand {
            budget: 12 << 30,
            run_sources: sources,
            fragment_bytes: 30_000,
            source_nodes: vec![per_node; sources.div_ceil(per_node) as usize],
            run_builders: 3,
            per_builder_queue: 64 * MB,
            builders: 3,
            builder_memory: 512 * MB,
            saver_memory: 341 * MB,
            fixed: vec![("runtime", 64 * MB)],
            per_source: 64 << 10,
        }
    }

    #[test]
    fn shares_fit_the_budget_and_sources_get_the_rest() {
        let p = demo(3000, 2).plan().unwrap();
        assert!(p.total() <= p.budget);
        // 12 GiB - 3 x 853 MiB - 64 MiB - 3000 x 64 KiB, over 1500 nodes.
        let rest = (12u64 << 30) - 3 * 853 * MB - 64 * MB - 3000 * (64 << 10);
        assert_eq!(p.source_node_limit, rest / 1500);
        // Few nodes: each is capped by its transport queues.
        let p = demo(10, 10).plan().unwrap();
        assert_eq!(p.source_node_limit, 3 * 64 * MB);
    }

    #[test]
    fn a_builder_that_cannot_hold_two_slices_is_refused() {
        let e = demo(100_000, 38).plan().unwrap_err();
        assert_eq!(
            e,
            Refusal::BuilderTooSmall { slice_bytes: 3_000_000_000, builder_memory: 512 * MB, needed: 6_000_000_000 }
        );
        assert!(e.to_string().contains("at least 2 slices"), "{e}");
    }

    #[test]
    fn fixed_bounds_over_the_budget_are_refused_with_the_detail() {
        let mut d = demo(3000, 2);
        d.budget = 2 << 30;
        let e = d.plan().unwrap_err();
        let Refusal::OverBudget { needed, .. } = &e else { panic!("{e}") };
        assert!(*needed > 2 << 30);
        assert!(e.to_string().contains("builders 3 x 512 MiB"), "{e}");
    }

    #[test]
    fn largest_fitting_finds_the_boundary() {
        assert_eq!(largest_fitting(100_000, |n| demo(n, 1).plan().is_ok()), Some(8947));
        assert_eq!(largest_fitting(10, |n| n <= 7), Some(7));
        assert_eq!(largest_fitting(10, |_| false), None);
        assert_eq!(largest_fitting(10, |_| true), Some(10));
    }
}
