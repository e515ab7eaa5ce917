//! `shoal diagnose RUN_RECORD`: every lost slice of a past run with its primary cause, and
//! the problems run control saw while it was on (docs/monitoring.md).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(clap::Args)]
pub struct DiagnoseArgs {
    /// A run record: `<state_dir>/runs/runNNNNNN.json`.
    record: PathBuf,
    /// Print the diagnosis as JSON (the record's `diagnosis` section, recomputed).
    #[arg(long)]
    json: bool,
}

/// Exit 0, or 1 when a lost slice has no known cause.
pub fn run(args: DiagnoseArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read(&args.record).with_context(|| format!("reading {}", args.record.display()))?;
    let record: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", args.record.display()))?;
    // Recomputed with today's rules from the record's facts and its timeline.
    let d = shoal_control::diagnose::diagnose_record(&record)
        .with_context(|| format!("diagnosing {}", args.record.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        let get = |k: &str| record.get(k).and_then(|r| r.as_u64()).unwrap_or(0);
        print!("{}", shoal_control::diagnose::describe(&d, get("run"), get("start_unix_ns")));
    }
    Ok(if d.slices.unexplained > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS })
}
