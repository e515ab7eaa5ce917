//! `shoal ledger REPORT.json...`: the books of a run whose processes were started by hand
//! (`shoal node --config`, the source SDK in C, Python or Rust): the end-of-run reports of
//! its sources and builders, combined into one ledger the way run control does it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use shoal_core::ingest::IngestReport;
use shoal_core::ledger::{BuilderTally, Ledger, SourceTally};
use shoal_core::{BuilderId, SourceId};
use shoal_net::demo::LedgerSummary;

#[derive(clap::Args)]
pub struct LedgerArgs {
    /// End-of-run reports: `run*.source*.json` and `run*.builder*.json` of `shoal node`,
    /// the JSON a source SDK's close returns; other files (the writer's) are skipped.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// What the inputs of the run's source processes counted, summed.
#[derive(Default, serde::Serialize)]
struct InputTotals {
    accepted: u64,
    late: u64,
    rejected: BTreeMap<String, u64>,
    lost_at_input: u64,
    discarded_at_end: u64,
    balanced: bool,
}

pub fn run(args: LedgerArgs) -> anyhow::Result<std::process::ExitCode> {
    let mut sources: BTreeMap<SourceId, SourceTally> = BTreeMap::new();
    let mut builders: BTreeMap<BuilderId, BuilderTally> = BTreeMap::new();
    let mut input = InputTotals { balanced: true, ..Default::default() };
    let mut used = 0;
    for path in &args.files {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        if let Some(t) = v.get("tallies") {
            let t: BTreeMap<SourceId, SourceTally> =
                serde_json::from_value(t.clone()).with_context(|| format!("{}: source tallies", path.display()))?;
            for (id, tally) in t {
                anyhow::ensure!(!sources.contains_key(&id), "source {id} is in two reports ({})", path.display());
                sources.insert(id, tally);
            }
            if let Some(i) = v.get("ingest").filter(|i| !i.is_null()) {
                let i: IngestReport =
                    serde_json::from_value(i.clone()).with_context(|| format!("{}: ingest report", path.display()))?;
                input.accepted += i.accepted;
                input.late += i.late;
                input.lost_at_input += i.lost_at_input;
                input.discarded_at_end += i.discarded_at_end;
                input.balanced &= i.balanced();
                for (k, n) in &i.rejected {
                    *input.rejected.entry(k.clone()).or_default() += n;
                }
            }
            used += 1;
        } else if let (Some(id), Some(t)) = (v.get("id"), v.get("tally")) {
            let id: BuilderId = serde_json::from_value(id.clone())?;
            let t: BuilderTally =
                serde_json::from_value(t.clone()).with_context(|| format!("{}: builder tally", path.display()))?;
            anyhow::ensure!(!builders.contains_key(&id), "builder {id} is in two reports ({})", path.display());
            builders.insert(id, t);
            used += 1;
        }
    }
    anyhow::ensure!(used > 0, "none of the files is a source's or a builder's report");
    let ledger = LedgerSummary::new(&Ledger::combine(&sources, &builders));
    let out = serde_json::json!({
        "sources": sources.len(),
        "builders": builders.len(),
        "ledger": ledger,
        "input": input,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    let ok = ledger.balanced && input.balanced;
    Ok(if ok { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE })
}
