//! The process's memory budget in practice: the machine's memory, the fragment size
//! measured from the workload, and the roles this process hosts, turned into
//! `shoal_core::budget`'s plan; a refusal gets what would fit.

use shoal_core::budget::{MemoryDemand, MemoryPlan, Refusal, largest_fitting, mib};
use shoal_core::frame::HEADER_LEN;
use shoal_core::runstate::Role;
use shoal_core::slice::SliceNumber;
use tracing::info;

use crate::config::{Config, ConfigError};

/// The tokio runtime, allocator slack and everything not a queue, per process.
const RUNTIME_BYTES: u64 = 64 << 20;
/// Per hosted source besides its backlog: generator, shaper, tallies, the builders' per
/// source state (measured: `shoal demo --sources 20000 --builders 1 --seconds 0.05` with
/// 100-byte fixed fragments peaks at about 1.3 GB, 65 KB a source).
const PER_SOURCE_BYTES: u64 = 64 << 10;
/// Per connection of an embedded run: read and write buffers in user space.
const PER_CONNECTION_BYTES: u64 = 64 << 10;
/// The writer's queue on its way to disk (bounded in bytes, `writer::DISK_QUEUE_KIB`).
const WRITER_BYTES: u64 = (crate::writer::DISK_QUEUE_KIB as u64) << 10;

/// What a process runs.
#[derive(Clone, Debug, Default)]
pub struct Hosting {
    /// Sources per source node (one entry per node).
    pub source_nodes: Vec<u64>,
    pub builders: u64,
    pub writer: bool,
    /// Data connections with both ends in this process (embedded runs).
    pub local_connections: u64,
}

/// This machine's physical memory, bytes (`MemTotal` of /proc/meminfo; 0 if unknown).
pub fn machine_memory() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The budget in force: `run.memory_mb`, or half the machine's memory (4 GiB if unknown).
pub fn budget_bytes(cfg: &Config) -> u64 {
    match cfg.run.memory_mb {
        0 => match machine_memory() {
            0 => 4 << 30,
            m => m / 2,
        },
        mb => mb << 20,
    }
}

/// The mean size of a fragment on the wire, from a sample of the configured workload (a
/// few sources, a few slices far from the start: deterministic, like the workload).
pub fn fragment_bytes(cfg: &Config) -> Result<u64, ConfigError> {
    let generator = cfg.generator()?;
    let sources = cfg.run.sources.min(8);
    let slices: std::ops::Range<SliceNumber> = 1000..1008;
    let (mut bytes, mut n) = (0u64, 0u64);
    for source in 0..sources {
        for slice in slices.clone() {
            bytes += generator.generate(source, slice).payload.len() as u64;
            n += 1;
        }
    }
    Ok(HEADER_LEN as u64 + bytes / n.max(1))
}

/// What each source node may hold computed ahead ([`crate::source::prefetch`]), out of its share
/// of the budget (`node_limit`): its sources' slices for `source.generate_ahead_ms`, twice
/// over for bursts, at most a quarter of its share and [`crate::source::prefetch::MAX_BYTES`]; 0
/// (computed at the slice end) when that is less than two slices, where a tight budget
/// leaves no room to be ahead.
fn prefetch_limit(cfg: &Config, hosting: &Hosting, fragment_bytes: u64, node_limit: u64) -> u64 {
    let ahead = crate::source::prefetch::ahead_slices(cfg).unwrap_or(0);
    let largest = hosting.source_nodes.iter().copied().max().unwrap_or(0);
    let slice = largest.saturating_mul(fragment_bytes);
    let limit =
        slice.saturating_mul(ahead).saturating_mul(2).min(crate::source::prefetch::MAX_BYTES).min(node_limit / 4);
    if ahead == 0 || limit < slice.saturating_mul(2) { 0 } else { limit }
}

/// What the datagram senders of this process's source nodes keep for NACKs at most: every
/// hosted source's data of the longest age kept (`udp.start_retransmit_age_ms` for a
/// stream's first seconds, else `udp.retransmit_age_ms`) plus the slice being sent, each
/// stream within `udp.retransmit_mb`. 0 over TCP or without sources. With a replay pool
/// the payloads are shared and this is an upper bound.
fn udp_retransmit_bytes(cfg: &Config, hosting: &Hosting, fragment_bytes: u64) -> u64 {
    if !matches!(cfg.transport(), Ok(crate::config::Transport::Udp)) {
        return 0;
    }
    let udp = cfg.udp_config();
    let sources: u64 = hosting.source_nodes.iter().sum();
    let age_ms = udp.retransmit_age.max(udp.start_retransmit_age).as_millis() as u64;
    let slices = age_ms.div_ceil(cfg.run.slice_ms.max(1)) + 1;
    let per_stream_cap = udp.retransmit_bytes.saturating_mul(u64::from(cfg.run.builders));
    sources.saturating_mul(fragment_bytes.saturating_mul(slices).min(per_stream_cap))
}

/// A process's memory plan: the budget's division, and the part of each source node's
/// share that holds slices computed ahead (the rest bounds its backlog).
#[derive(Clone, Debug)]
pub struct ProcessPlan {
    pub memory: MemoryPlan,
    pub prefetch_limit: u64,
}

fn demand(cfg: &Config, hosting: &Hosting, fragment_bytes: u64) -> MemoryDemand {
    let saver = if cfg.saver.enabled { cfg.saver.max_mb << 20 } else { 0 };
    let mut fixed = vec![("runtime", RUNTIME_BYTES)];
    if hosting.writer {
        fixed.push(("writer queues", WRITER_BYTES));
    }
    if hosting.local_connections > 0 {
        fixed.push(("connection buffers", hosting.local_connections * PER_CONNECTION_BYTES));
    }
    let retransmit = udp_retransmit_bytes(cfg, hosting, fragment_bytes);
    if retransmit > 0 {
        fixed.push(("UDP retransmit buffers", retransmit));
    }
    MemoryDemand {
        budget: budget_bytes(cfg),
        run_sources: u64::from(cfg.run.sources),
        fragment_bytes,
        source_nodes: hosting.source_nodes.clone(),
        run_builders: u64::from(cfg.run.builders),
        per_builder_queue: cfg.source.queue_limit_mb << 20,
        builders: hosting.builders,
        builder_memory: cfg.builder.memory_budget_mb << 20,
        saver_memory: saver,
        fixed,
        per_source: PER_SOURCE_BYTES,
    }
}

/// The builders' memory (`builder.memory_budget_mb`, MiB) for a process that hosts several
/// builders (the embedded demo) when the configured one does not fit the process's budget:
/// half of what the budget leaves once everything else has its share (the sources their
/// least backlog), in equal parts, so that the other half stays for the sources. `None`
/// when the configured value fits, when the process hosts one builder (a builder process
/// of its own keeps what it was given), or when the share would not hold a builder's two
/// slices: the run is then refused as before, with its reasons.
pub fn shared_builder_memory_mb(cfg: &Config, hosting: &Hosting) -> Result<Option<u64>, ConfigError> {
    if hosting.builders < 2 {
        return Ok(None);
    }
    let frag = fragment_bytes(cfg)?;
    let plan_with = |mb: u64| {
        let mut d = demand(cfg, hosting, frag);
        d.builder_memory = mb << 20;
        d.plan()
    };
    if !matches!(plan_with(cfg.builder.memory_budget_mb), Err(Refusal::OverBudget { .. })) {
        return Ok(None);
    }
    // The most each builder could take with the sources at their least backlog (the
    // builders' memory only ever adds to what the process needs).
    let not_over = |mb: u64| !matches!(plan_with(mb), Err(Refusal::OverBudget { .. }));
    let Some(most) = largest_fitting(cfg.builder.memory_budget_mb, not_over) else {
        return Ok(None);
    };
    let share = (most / 2).max(1);
    Ok(plan_with(share).is_ok().then_some(share))
}

/// Seconds of its offered data that `shoal demo` maps before the run when nothing sets
/// `run.prefault_mb` ([`auto_prefault`]). Live demos on time with nothing mapped peaked
/// at 3.1-5.7 s of what their sources delivered (2026-11-29: 300 x 100 2.7-3.4 GB at
/// 861-881 MB/s, 200 x 60 2.4 GB at 579, 100 x 30 1.7 GB at 292); with memory mapped the
/// allocator keeps what it frees, and the full shape peaked at 4.6-4.9 GB. The estimate of
/// the offered rate ([`offered_bytes_per_s`]) is about a tenth under what the full shape
/// delivers; 6 s of it is 4.3 GiB there, where 4 GiB kept every slice in 9 of 10 runs on a
/// busy day and 6 GiB in 7 of 7 (docs/bench/history.md, "Memory mapped before the run"). A
/// run behind holds more, and more again: the mapping is there so that faulting its
/// memory in does not put it behind in the first place.
pub const AUTO_PREFAULT_SECONDS: u64 = 6;
/// No automatic prefault below this: a smaller working set faulted in costs a run little
/// (the summary's hint waits for a GiB of faults too).
pub const AUTO_PREFAULT_MIN_MB: u64 = 1024;

/// What the configured sources offer, bytes per second: the sample's mean fragment
/// ([`fragment_bytes`]) from every source every slice. `None` where there is no rate to
/// know: saturating sources produce what the transport takes, and an input socket's
/// data comes from outside.
pub fn offered_bytes_per_s(cfg: &Config) -> Result<Option<u64>, ConfigError> {
    if cfg.source.saturate || !cfg.source.input.is_empty() || cfg.run.slice_ms == 0 {
        return Ok(None);
    }
    let per_slice = fragment_bytes(cfg)?.saturating_mul(u64::from(cfg.run.sources));
    Ok(Some(per_slice.saturating_mul(1000) / cfg.run.slice_ms))
}

/// What [`auto_prefault`] chose, and from what rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoPrefault {
    /// The `run.prefault_mb` to map.
    pub mb: u64,
    /// [`offered_bytes_per_s`], which it was sized from.
    pub offered_bytes_per_s: u64,
}

/// The `run.prefault_mb` that `shoal demo` takes when nothing sets it:
/// [`AUTO_PREFAULT_SECONDS`] of the offered data (a shorter run's whole data), at most half
/// the budget (the plan's queues keep the other half), `None` under
/// [`AUTO_PREFAULT_MIN_MB`] or where the rate is not known ([`offered_bytes_per_s`]).
pub fn auto_prefault(cfg: &Config) -> Result<Option<AutoPrefault>, ConfigError> {
    let Some(rate) = offered_bytes_per_s(cfg)? else { return Ok(None) };
    Ok(prefault_for(rate, cfg.run.seconds, budget_bytes(cfg)).map(|mb| AutoPrefault { mb, offered_bytes_per_s: rate }))
}

fn prefault_for(offered_bytes_per_s: u64, run_seconds: f64, budget: u64) -> Option<u64> {
    let seconds = run_seconds.clamp(0.0, AUTO_PREFAULT_SECONDS as f64);
    let bytes = (offered_bytes_per_s as f64 * seconds) as u64;
    let mb = (bytes >> 20).min((budget / 2) >> 20);
    (mb >= AUTO_PREFAULT_MIN_MB).then_some(mb)
}

/// Plans the process's memory, or refuses with why and what would fit. `hosting_for(n)`
/// says what the process would host with `n` sources in the run (to find the largest `n`
/// that fits).
pub fn plan(cfg: &Config, hosting_for: impl Fn(u32) -> Hosting) -> Result<ProcessPlan, ConfigError> {
    let budget = budget_bytes(cfg);
    if cfg.run.prefault_mb.saturating_mul(1 << 20) > budget {
        return Err(ConfigError::Invalid(format!(
            "run.prefault_mb = {} is more than this process's memory budget ({} MiB, run.memory_mb)",
            cfg.run.prefault_mb,
            budget >> 20
        )));
    }
    let frag = fragment_bytes(cfg)?;
    let with_sources = |n: u32| {
        let mut c = cfg.clone();
        c.run.sources = n;
        demand(&c, &hosting_for(n), frag).plan()
    };
    let refusal = match with_sources(cfg.run.sources) {
        Ok(memory) => {
            let prefetch_limit = prefetch_limit(cfg, &hosting_for(cfg.run.sources), frag, memory.source_node_limit);
            return Ok(ProcessPlan { memory, prefetch_limit });
        }
        Err(r) => r,
    };
    let fit = largest_fitting(u64::from(cfg.run.sources), |n| with_sources(n as u32).is_ok());
    let budget = budget_bytes(cfg);
    // With builders that hold their two slices, the least the whole process would need.
    let raised = |needed: u64| {
        let mut d = demand(cfg, &hosting_for(cfg.run.sources), frag);
        d.builder_memory = needed;
        d.budget = 0;
        match d.plan() {
            Err(Refusal::OverBudget { needed, .. }) => needed.div_ceil(1 << 20),
            _ => 0,
        }
    };
    let hint = match (&refusal, fit) {
        (Refusal::BuilderTooSmall { needed, .. }, Some(n)) => format!(
            "at most {n} sources fit these settings; or raise builder.memory_budget_mb to {} (the process then needs \
             run.memory_mb = {}, this budget is {})",
            needed.div_ceil(1 << 20),
            raised(*needed),
            mib(budget)
        ),
        (Refusal::BuilderTooSmall { needed, .. }, None) => format!(
            "raise builder.memory_budget_mb to {} (the process then needs run.memory_mb = {})",
            needed.div_ceil(1 << 20),
            raised(*needed)
        ),
        (Refusal::OverBudget { needed, .. }, Some(n)) => format!(
            "at most {n} sources fit a budget of {}; or raise run.memory_mb to {} if the machine has it",
            mib(budget),
            needed.div_ceil(1 << 20)
        ),
        (Refusal::OverBudget { .. }, None) => {
            "lower builder.memory_budget_mb or saver.max_mb, or raise run.memory_mb if the machine has it".into()
        }
    };
    Err(ConfigError::Invalid(format!(
        "refused at start, memory: {refusal} (fragments about {} bytes). What fits: {hint}",
        frag
    )))
}

/// What `shoal node --role ROLE` hosts.
pub fn hosting_for_role(cfg: &Config, role: Role, sources: u32) -> Hosting {
    match role {
        Role::Source => {
            let n = if cfg.source.ids.is_empty() { u64::from(sources) } else { cfg.source.ids.len() as u64 };
            Hosting { source_nodes: vec![n], ..Hosting::default() }
        }
        Role::Builder => Hosting { builders: 1, ..Hosting::default() },
        Role::Writer => Hosting { writer: true, ..Hosting::default() },
        Role::Dfm => Hosting::default(),
    }
}

/// How many sources share one process (and so one connection per builder) so that all
/// connections of an embedded run fit under the open-file limit (two descriptors per
/// loopback connection, both ends in this process).
pub fn sources_per_node(sources: u32, builders: u32, fd_limit: u64) -> usize {
    let budget = (fd_limit.saturating_sub(256) * 8 / 10).max(64);
    let needed = 2 * u64::from(sources) * u64::from(builders);
    needed.div_ceil(budget).clamp(1, u64::from(sources.max(1))) as usize
}

/// What an embedded run of `sources` sources hosts: every source node, every builder and
/// the writer, and both ends of every connection.
pub fn embedded_hosting(sources: u32, builders: u32, fd_limit: u64) -> Hosting {
    let per_node = sources_per_node(sources, builders, fd_limit) as u64;
    let sources = u64::from(sources);
    let mut source_nodes = vec![per_node; (sources / per_node) as usize];
    if sources % per_node > 0 {
        source_nodes.push(sources % per_node);
    }
    let local_connections = 2 * source_nodes.len() as u64 * u64::from(builders);
    Hosting { source_nodes, builders: u64::from(builders), writer: true, local_connections }
}

/// Divides this process's memory budget for its role (or refuses the configuration with
/// what would fit), logs the plan and maps `run.prefault_mb`.
pub fn apply_memory_plan(cfg: &mut Config, role: Role) -> Result<(), ConfigError> {
    let plan = plan(cfg, |n| hosting_for_role(cfg, role, n))?;
    apply(cfg, &plan);
    info!("{}", describe(&plan));
    // When the process is configured, as a DAQ allocates its buffers: a controlled node
    // is configured before run control starts a run.
    crate::memory::prefault_configured(cfg.run.prefault_mb);
    Ok(())
}

/// Applies a plan to the configuration: each source node holds at most its share.
pub fn apply(cfg: &mut Config, plan: &ProcessPlan) {
    if plan.memory.source_node_limit > 0 {
        cfg.source.held_limit_bytes = Some(plan.memory.source_node_limit - plan.prefetch_limit);
    }
    cfg.source.prefetch_limit_bytes = Some(plan.prefetch_limit);
}

/// One line for the log.
pub fn describe(plan: &ProcessPlan) -> String {
    let plan = &plan.memory;
    let shares = plan.shares.iter().map(|(n, b)| format!("{n} ({})", mib(*b))).collect::<Vec<_>>().join(", ");
    format!("memory budget {}: {shares}; {} planned", mib(plan.budget), mib(plan.total()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosting(nodes: Vec<u64>) -> Hosting {
        Hosting { source_nodes: nodes, ..Hosting::default() }
    }

    #[test]
    fn datagram_sources_plan_what_they_keep_for_nacks() {
        let mut cfg = Config::from_toml_str("[run]\nbuilders = 10\ntransport = \"udp\"\n").unwrap();
        // 2 s of 10-ms slices kept at a stream's start, plus the slice being sent.
        assert_eq!(udp_retransmit_bytes(&cfg, &hosting(vec![4, 4]), 30_000), 8 * 30_000 * 201);
        // Each stream keeps at most udp.retransmit_mb.
        cfg.udp.retransmit_mb = 1;
        assert_eq!(udp_retransmit_bytes(&cfg, &hosting(vec![4]), 1 << 20), 4 * 10 * (1 << 20));
        // Nothing without sources, and nothing over TCP.
        assert_eq!(udp_retransmit_bytes(&cfg, &hosting(vec![]), 30_000), 0);
        cfg.run.transport = "tcp".into();
        assert_eq!(udp_retransmit_bytes(&cfg, &hosting(vec![4]), 30_000), 0);
        // In the plan, as its own share.
        cfg.run.transport = "udp".into();
        let d = demand(&cfg, &hosting(vec![4]), 30_000);
        assert!(d.fixed.iter().any(|&(name, bytes)| name == "UDP retransmit buffers" && bytes == 4 * 30_000 * 201));
    }

    fn plan_of(cfg: &Config, hosting: &Hosting) -> Result<MemoryPlan, Refusal> {
        demand(cfg, hosting, fragment_bytes(cfg).unwrap()).plan()
    }

    #[test]
    fn builders_sharing_a_process_take_half_of_what_their_budget_leaves() {
        // The full ANTARES shape in one process of 12 GiB: 100 builders at 512 MiB do not fit.
        let mut cfg = Config::from_toml_str("[run]\nmemory_mb = 12288\nsources = 300\nbuilders = 100\n").unwrap();
        cfg.share_saver_history();
        let embedded = embedded_hosting(300, 100, 20_000);
        let share = shared_builder_memory_mb(&cfg, &embedded).unwrap().expect("a share");
        // Half of the most they could take: the plan fits with it, not with twice it plus
        // a little (the most), and each builder still holds two slices of 300 fragments.
        let with = |mb: u64| {
            let mut c = cfg.clone();
            c.builder.memory_budget_mb = mb;
            plan(&c, |n| embedded_hosting(n, 100, 20_000))
        };
        assert!(with(share).is_ok() && with(2 * share).is_ok());
        assert!(with(2 * share + 2).is_err());
        let fragment = fragment_bytes(&cfg).unwrap();
        assert!(share << 20 >= 2 * 300 * fragment, "{share} MiB");
        // What fits already, and a builder process of its own, are left as they are.
        let mut fits = cfg.clone();
        fits.builder.memory_budget_mb = share;
        assert_eq!(shared_builder_memory_mb(&fits, &embedded).unwrap(), None);
        let alone = Hosting { builders: 1, writer: false, ..Hosting::default() };
        assert_eq!(shared_builder_memory_mb(&cfg, &alone).unwrap(), None);
        // A share that cannot hold two slices is no share: the run stays refused.
        let mut big = cfg.clone();
        big.run.sources = 3_000;
        let hosting = embedded_hosting(3_000, 100, 20_000);
        assert!(matches!(plan_of(&big, &hosting), Err(Refusal::OverBudget { .. })));
        assert_eq!(shared_builder_memory_mb(&big, &hosting).unwrap(), None);
    }

    #[test]
    fn the_demo_maps_seconds_of_its_offered_data_within_half_its_budget() {
        const GB: u64 = 1 << 30;
        const S: u64 = AUTO_PREFAULT_SECONDS;
        // 870 MB/s (the live full shape) in a 12-GiB budget: S seconds of it, under half,
        // for a run of S seconds or longer.
        assert_eq!(prefault_for(870_000_000, 15.0, 12 * GB), Some((870_000_000 * S) >> 20));
        assert_eq!(prefault_for(870_000_000, S as f64, 12 * GB), Some((870_000_000 * S) >> 20));
        // A shorter run: its whole data; a second of it is under the least.
        assert_eq!(prefault_for(870_000_000, 3.0, 12 * GB), Some((870_000_000 * 3) >> 20));
        assert_eq!(prefault_for(870_000_000, 1.0, 12 * GB), None);
        // 2 GB/s: half the budget.
        assert_eq!(prefault_for(2_000_000_000, 15.0, 12 * GB), Some(6 * 1024));
        // 13 MB/s (make demo): nothing; the least, and just under it.
        assert_eq!(prefault_for(13_000_000, 10.0, 12 * GB), None);
        assert_eq!(prefault_for(GB / S + 1, 15.0, 12 * GB), Some(1024));
        assert_eq!(prefault_for(GB / S - 1024, 15.0, 12 * GB), None);
        // A small machine: half of 1.5 GiB is under the least.
        assert_eq!(prefault_for(870_000_000, 15.0, 3 * GB / 2), None);
        // From the configuration: 300 sources of about 30 kB every 10 ms; none saturating
        // or reading an input socket.
        let cfg = Config::from_toml_str("[run]\nmemory_mb = 12288\nsources = 300\nbuilders = 100\n").unwrap();
        let rate = offered_bytes_per_s(&cfg).unwrap().expect("a rate");
        assert_eq!(rate, fragment_bytes(&cfg).unwrap() * 300 * 100);
        assert!((500_000_000..1_500_000_000).contains(&rate), "{rate}");
        assert_eq!(
            auto_prefault(&cfg).unwrap(),
            Some(AutoPrefault { mb: (rate * S) >> 20, offered_bytes_per_s: rate })
        );
        let mut saturated = cfg.clone();
        saturated.source.saturate = true;
        assert_eq!(auto_prefault(&saturated).unwrap(), None);
        let mut input = cfg.clone();
        input.source.input = "unix:/tmp/in.sock".into();
        assert_eq!(auto_prefault(&input).unwrap(), None);
    }

    #[test]
    fn a_prefault_over_the_budget_is_refused() {
        let cfg = |prefault: u64| {
            Config::from_toml_str(&format!("[run]\nmemory_mb = 8192\nprefault_mb = {prefault}\n")).unwrap()
        };
        let hosting = |_| Hosting { source_nodes: vec![5], builders: 3, writer: true, ..Hosting::default() };
        plan(&cfg(8192), hosting).expect("within the budget");
        let e = plan(&cfg(8193), hosting).unwrap_err().to_string();
        assert!(e.contains("run.prefault_mb = 8193") && e.contains("8192 MiB"), "{e}");
    }
}
